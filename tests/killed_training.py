"""Run by test_torch.py: a `boundedloss train` run whose every rank is killed with
SIGKILL right after the checkpoint of a given epoch - no cleanup, no goodbye.

argv: the TrainConfig as JSON (with checkpoint_every), the epoch to die after, a free
port. Each rank runs ``train_rank`` (what `boundedloss train` runs per rank) in a spawned
process, with ``save_checkpoint`` wrapped: once every rank has written its file of that
epoch (a barrier), the rank SIGKILLs itself. Prints each rank's exit code as JSON.
"""

import json
import os
import signal
import sys

import torch.multiprocessing as mp


def rank_main(rank, world, port, config, die_after):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch.distributed as dist

    from boundedloss.experiments import train

    write = train.save_checkpoint

    def write_then_die(path, checkpoint):
        write(path, checkpoint)
        if checkpoint["epoch"] == die_after:
            dist.barrier()  # every rank's checkpoint is written
            os.kill(os.getpid(), signal.SIGKILL)

    train.save_checkpoint = write_then_die
    train.train_rank(train.TrainConfig(**config), rank, world)


if __name__ == "__main__":
    config, die_after, port = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    ctx = mp.get_context("spawn")
    world = config["workers"]
    ranks = [ctx.Process(target=rank_main, args=(r, world, port, config, die_after))
             for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=200)
    print(json.dumps([p.exitcode for p in ranks]))
