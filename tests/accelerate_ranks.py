"""Run by test_accelerate.py under torchrun (every rank runs it): an Accelerate job on
CPU ranks (Gloo) training the digits MLP, as README's recipe writes it.

argv: OUT (a folder), EPOCHS[, SEED (default 0)]. It trains twice from the same seed,
each run with an Accelerator of its own:
  1. plain DDP: rank 0 writes OUT/plain.json (test accuracy);
  2. DBLP, registered on what ``accelerator.prepare`` returned, with 2% of the datagrams
     each rank receives lost in-process, and ``state.epoch_end`` after each epoch's
     scheduler step: each rank writes OUT/dblp.rank{R}.json (accuracy, steps, the hook's
     counters, DBLP's decisions); then ``accelerator.save_state`` with the hook state
     registered for checkpointing (EveryRankState), and a third Accelerator's
     ``load_state`` into a fresh registration: each rank writes the hook state it held
     at the save (OUT/saved.rank{R}.pt) and once loaded (OUT/loaded.rank{R}.pt).
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from boundedloss.net.loss import Bernoulli
from boundedloss.torch import EveryRankState, register
from boundedloss.workloads.digits import load_digits_split
from boundedloss.workloads.images import ImageMLP, accuracy
from hook_record import hook_record

DATA = load_digits_split(seed=0)


def prepared(accelerator, seed, epochs):
    """The model, optimizer and batches as Accelerate hands them out, and the LR
    schedule (left unprepared: Accelerate would step it once per rank)."""
    torch.manual_seed(seed)
    net = ImageMLP(DATA.side, hidden=256)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(DATA.x_train, DATA.y_train), batch_size=32, shuffle=True)
    model, opt, loader = accelerator.prepare(net, opt, loader)
    # an LR change half way: DBLP must mark the epoch after it critical
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=epochs // 2, gamma=0.2)
    return model, opt, loader, sched


def train(accelerator, model, opt, loader, sched, epochs, state=None) -> int:
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            steps += 1
        sched.step()
        if state is not None:
            state.epoch_end(opt)  # (after the scheduler: an LR change marks the next epoch)
    return steps


def main(out: Path, epochs: int, seed: int) -> None:
    torch.set_num_threads(1)  # (ranks share the machine's cores)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model, opt, loader, sched = prepared(accelerator, seed, epochs)
    train(accelerator, model, opt, loader, sched, epochs)
    net = accelerator.unwrap_model(model)
    if rank == 0:
        (out / "plain.json").write_text(json.dumps(
            {"accuracy": accuracy(net, DATA.x_test, DATA.y_test)}))

    accelerator = Accelerator(cpu=True)
    model, opt, loader, sched = prepared(accelerator, seed, epochs)
    state = register(model, policy="dblp", loss=Bernoulli(0.02, seed=rank))
    steps = train(accelerator, model, opt, loader, sched, epochs, state)
    net = accelerator.unwrap_model(model)
    (out / f"dblp.rank{rank}.json").write_text(json.dumps({
        "accuracy": accuracy(net, DATA.x_test, DATA.y_test), "steps": steps,
        **hook_record(state)}))

    accelerator.register_for_checkpointing(EveryRankState(state))
    accelerator.save_state(out / "state")
    torch.save(state.state_dict(), out / f"saved.rank{rank}.pt")
    accelerator.wait_for_everyone()
    state.close()  # (after every rank's last round: see docs/torch.md)

    accelerator = Accelerator(cpu=True)
    model, opt, loader, sched = prepared(accelerator, seed + 1, epochs)
    again = register(model, policy="dblp")
    accelerator.register_for_checkpointing(EveryRankState(again))
    accelerator.load_state(out / "state")
    torch.save(again.state_dict(), out / f"loaded.rank{rank}.pt")
    accelerator.wait_for_everyone()
    again.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
