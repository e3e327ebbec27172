"""`boundedloss doctor`: its findings, its exit status, and why no kernel network can be
had here (the cause and the one command that fixes it)."""

from __future__ import annotations

import functools

import pytest
from click.testing import CliRunner

from boundedloss import doctor
from boundedloss.cli import cli, main
from boundedloss.doctor import CAUSES, FAIL, INFO, OK, WARN, Finding, kernel_network_cause

DENIED = ("the kernel testbed needs root or unprivileged user namespaces: this kernel does "
          "not let an unprivileged user make namespaces (unshare: unshare failed: "
          "Operation not permitted)")


def _root(tmp_path, seccomp: int = 0, **sysctls: str):
    """A file tree that stands for /: /proc/self/status with its Seccomp mode, and the
    sysctls given (``kernel__unprivileged_userns_clone="0"`` is
    proc/sys/kernel/unprivileged_userns_clone)."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "status").write_text(
        f"Name:\tpython\nSeccomp:\t{seccomp}\nSeccomp_filters:\t{int(seccomp == 2)}\n")
    for name, value in sysctls.items():
        path = tmp_path / "proc" / "sys" / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    return tmp_path


@pytest.mark.parametrize("reason, privileged, seccomp, sysctls, cause", [
    # the kernel lacks nf_tables: root or not
    ("iptables: Failed to initialize nft: Protocol not supported", True, 0, {}, "nf_tables"),
    ("nf_tables: [Errno 93] Protocol not supported", False, 2,
     {"kernel__unprivileged_userns_clone": "0"}, "nf_tables"),
    ("nf_tables is not available: Protocol not supported", True, 0, {}, "nf_tables"),
    # what the testbed's Python, or the user namespace, needs
    ("pyroute2 is not installed (No module named 'pyroute2.netlink.nfnetlink'); pip "
     "install pyroute2", True, 0, {}, "pyroute2"),
    ("the kernel testbed needs root or unprivileged user namespaces: unshare is not "
     "installed (util-linux)", False, 0, {"kernel__unprivileged_userns_clone": "1"},
     "unshare"),
    ("the kernel testbed needs root or unprivileged user namespaces: unshare is not "
     "installed (util-linux)", False, 0, {"kernel__unprivileged_userns_clone": "0"},
     "userns_clone"),  # (installing it would not help)
    # no root: what keeps a user namespace from being made
    (DENIED, False, 0, {"user__max_user_namespaces": "0",
                        "kernel__unprivileged_userns_clone": "0"}, "max_user_namespaces"),
    (DENIED, False, 0, {"user__max_user_namespaces": "15000",
                        "kernel__unprivileged_userns_clone": "0"}, "userns_clone"),
    (DENIED, False, 0, {"kernel__unprivileged_userns_clone": "1",
                        "kernel__apparmor_restrict_unprivileged_userns": "1"}, "apparmor"),
    # a container's seccomp profile denies unshare before the host's AppArmor has a say
    (DENIED, False, 2, {"kernel__apparmor_restrict_unprivileged_userns": "1"}, "seccomp"),
    (DENIED, False, 2, {}, "seccomp"),
    # a seccomp filter, but nothing was denied: not the cause
    ("the kernel testbed needs root or unprivileged user namespaces: unshare failed: "
     "[Errno 2] No such file or directory", False, 2, {}, "no_root"),
    (DENIED, False, 0, {"kernel__unprivileged_userns_clone": "1",
                        "kernel__apparmor_restrict_unprivileged_userns": "0"}, "no_root"),
    (DENIED, False, 0, {}, "no_root"),
    # root: the namespaces themselves are denied by a container's seccomp
    ("cannot create a network namespace: Operation not permitted", True, 2, {}, "seccomp"),
    ("cannot create a network namespace: Operation not permitted", True, 0, {}, None),
    ("something no one has seen", True, 0, {"kernel__unprivileged_userns_clone": "0"}, None),
])
def test_the_cause_of_no_kernel_network(tmp_path, reason, privileged, seccomp, sysctls, cause):
    root = _root(tmp_path, seccomp, **sysctls)
    found = kernel_network_cause(reason, privileged=privileged, root=root)
    assert found == (CAUSES[cause] if cause else None)


def test_the_cause_without_a_proc_to_read(tmp_path):
    """Nothing under /proc to read (another kernel, a sandbox): the reason alone."""
    assert kernel_network_cause(DENIED, privileged=False, root=tmp_path) == CAUSES["no_root"]
    assert kernel_network_cause(DENIED, privileged=True, root=tmp_path) is None
    assert kernel_network_cause("no nf_tables", privileged=True,
                                root=tmp_path) == CAUSES["nf_tables"]


def test_every_cause_has_one_command_that_fixes_it():
    for name, cause in CAUSES.items():
        assert cause.fix and "\n" not in cause.fix + cause.cause, name
    assert CAUSES["userns_clone"].fix == (f"{doctor.SUDO_DEMO}, or sudo sysctl -w "
                                          "kernel.unprivileged_userns_clone=1")
    assert CAUSES["apparmor"].fix.startswith(
        "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0")
    assert CAUSES["max_user_namespaces"].fix == "sudo sysctl -w user.max_user_namespaces=15000"
    assert "--privileged" in CAUSES["seccomp"].fix and "--cap-add NET_ADMIN" in \
        CAUSES["seccomp"].fix
    assert CAUSES["nf_tables"].fix == "sudo modprobe nf_tables"


def test_sudo_demo_names_the_command_sudo_would_not_find(monkeypatch):
    """sudo's secure_path holds the system's folders only: a boundedloss there is named
    as is, one in a virtual environment by its full path (quoted for the shell)."""
    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/local/bin/boundedloss")
    assert doctor._sudo_demo() == "sudo boundedloss demo"  # noqa: SLF001
    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/home/a b/.venv/bin/boundedloss")
    assert doctor._sudo_demo() == "sudo '/home/a b/.venv/bin/boundedloss' demo"  # noqa: SLF001
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor._sudo_demo() == "sudo boundedloss demo"  # noqa: SLF001


def test_the_fallback_note_says_why_and_how_to_fix_it():
    note = doctor.no_kernel_network("iptables: Failed to initialize nft", privileged=True)
    assert note == ("no kernel network here: iptables: Failed to initialize nft - the kernel "
                    "has no nf_tables (the testbed's drop rules); fix: sudo modprobe nf_tables")
    # a reason that names what is missing is not said twice
    assert doctor.no_kernel_network("pyroute2 is not installed (x); pip install pyroute2",
                                    privileged=True) == (
        "no kernel network here: pyroute2 is not installed (x); pip install pyroute2; fix: "
        "pip install pyroute2")
    assert doctor.no_kernel_network("needs root", privileged=True) == (
        "no kernel network here: needs root")


# ------------------------------------------------------------------------ the checks
@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """check_kernel_network with the testbed's answers and /proc given by the test."""
    import boundedloss.emulate as emulate
    from boundedloss.emulate import rootless

    monkeypatch.delenv(rootless.INSIDE, raising=False)
    monkeypatch.setattr(doctor, "kernel_network_cause", functools.partial(
        kernel_network_cause, root=_root(tmp_path, 0, kernel__unprivileged_userns_clone="0")))

    def answers(needed=False, possible=(True, ""), available=(True, "")):
        monkeypatch.setattr(rootless, "needed", lambda: needed)
        monkeypatch.setattr(rootless, "possible", lambda: possible)
        monkeypatch.setattr(emulate, "available", lambda: available)
        return doctor.check_kernel_network()

    return answers


def test_kernel_network_as_root(kernel):
    f = kernel(available=(True, ""))
    assert (f.item, f.state, f.fix) == ("kernel network", OK, "")
    assert f.text.startswith("root: the testbed runs here")
    f = kernel(available=(False, "nf_tables is not available: Protocol not supported"))
    assert f.state == FAIL and f.broken and f.fix == "sudo modprobe nf_tables"
    assert f.text.startswith("root, but nf_tables is not available")
    assert "gloo runs lossless" in f.text


def test_kernel_network_rootless(kernel, monkeypatch):
    from boundedloss.emulate import rootless

    # not root, and no user namespace can be made: why, and the fix
    f = kernel(needed=True, possible=(False, "this kernel does not let an unprivileged "
                                             "user make namespaces (unshare failed: "
                                             "Operation not permitted)"))
    assert f.state == FAIL and f.fix == CAUSES["userns_clone"].fix
    assert "kernel.unprivileged_userns_clone = 0" in f.text
    # inside the user namespace the doctor re-ran itself in: probed there
    monkeypatch.setenv(rootless.INSIDE, "1")
    f = kernel(needed=False, available=(True, ""))
    assert f.state == OK and f.text.startswith("rootless (root of a user namespace")
    monkeypatch.delenv(rootless.INSIDE)
    # possible, but not entered: not claimed to work
    assert kernel(needed=True, possible=(True, "")).state == WARN


def test_the_local_checks_run_here():
    """The compiled path, OpenSSL and the GPU are read from this machine: a finding each,
    one line; OpenSSL's GMAC matches the known answer wherever the suite runs (the
    authentication tests need it too)."""
    auth = doctor.check_authentication()
    assert auth.state == OK, auth
    assert "AES-256-GMAC by OpenSSL" in auth.text and "known answer" in auth.text
    path = doctor.check_data_path()
    assert path.state in (OK, WARN) and not path.broken
    gpu = doctor.check_gpu()
    assert gpu.state == INFO and not gpu.broken
    for f in (auth, path, gpu):
        assert "\n" not in f.text + f.fix


def test_no_compiled_path_is_a_warning_with_a_fix(monkeypatch):
    from boundedloss import native

    monkeypatch.setattr(native, "enabled", lambda: False)
    monkeypatch.setattr(native, "status", lambda: "python (the compiled extension is not "
                                                  "built (No module named x))")
    f = doctor.check_data_path()
    assert f.state == WARN and not f.broken and "build-essential" in f.fix
    monkeypatch.setattr(native, "status", lambda: "python (BOUNDEDLOSS_NATIVE=0)")
    assert doctor.check_data_path().fix == "unset BOUNDEDLOSS_NATIVE"


def test_a_wrong_gmac_fails_authentication(monkeypatch):
    monkeypatch.setattr(doctor, "GMAC_KNOWN_ANSWER", bytes(12))
    f = doctor.check_authentication()
    assert f.state == FAIL and f.broken and "wrong" in f.text


# ------------------------------------------------------------------------ the command
def _fake_checks(monkeypatch, *findings: Finding) -> list[str]:
    entered: list[str] = []
    monkeypatch.setattr(doctor, "own_user_namespace", lambda: entered.append("userns"))
    monkeypatch.setattr(doctor, "CHECKS", tuple((lambda f=f: f) for f in findings))
    return entered


FINDINGS = (
    Finding("data path", OK, "native"),
    Finding("authentication", OK, "AES-256-GMAC by OpenSSL 3 [/usr/lib/libcrypto.so.3]"),
    Finding("kernel network", OK, "root: the testbed runs here"),
    Finding("GPU", INFO, "none"),
)


def test_doctor_prints_one_line_per_item_and_exits_0(monkeypatch):
    entered = _fake_checks(monkeypatch, *FINDINGS)
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 4 and entered == ["userns"]
    assert [line.split()[:2] for line in lines] == [
        ["ok", "data"], ["ok", "authentication"], ["ok", "kernel"], ["-", "GPU"]]
    assert "[/usr/lib/libcrypto.so.3]" in lines[1]  # (text, not markup)


def test_doctor_exits_0_on_a_warning_and_1_when_the_demo_cannot_run(monkeypatch, capsys):
    slow = Finding("data path", WARN, "python (not built)", "pip install ...")
    _fake_checks(monkeypatch, slow, *FINDINGS[1:])
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0 and result.output.splitlines()[0].startswith("warn")
    assert result.output.splitlines()[0].endswith("- fix: pip install ...")

    broken = Finding("kernel network", FAIL, "no root - user namespaces forbidden",
                     CAUSES["userns_clone"].fix)
    _fake_checks(monkeypatch, *FINDINGS[:2], broken, FINDINGS[3])
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 1
    line = result.output.splitlines()[2]
    assert line.startswith("FAIL kernel network") and line.endswith(
        f"fix: {doctor.SUDO_DEMO}, or sudo sysctl -w kernel.unprivileged_userns_clone=1")
    # the installed command's exit status too
    assert main(["doctor"]) == 1
    out = capsys.readouterr()
    assert out.out.count("\n") == 4 and out.err == ""
