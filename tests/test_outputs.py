"""Outputs after a kill and with a second command (issue 24, classes 3 and 4): a folder swap killed between
any two of its steps leaves the old or the new complete folder once the next run has recovered it, with
nothing else left; the locks refuse a second writer in one line and die with their holder; the user's umask
decides the modes. A kill is simulated in-process by an exception that nothing catches at the injection
points (outputs._fault); a real process is used only where the point is a process (a lock's holder)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bam import outputs

pytestmark = pytest.mark.slow  # locks held by other processes, and commands run against each other

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCHANGE_POINTS = ["complete", "journal", "exchanged", "old removed"]
RENAME_POINTS = ["complete", "old aside", "new in place"]


class Killed(BaseException):
    """A kill: nothing in the code under test catches it."""


def write_version(folder, version):
    os.makedirs(folder, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(folder, name), "w") as f:
            f.write(f"{version} {name}")


def version_of(folder):
    """"old" or "new" when the folder is one complete version, else what is wrong."""
    if not os.path.isdir(folder):
        return "missing"
    contents = {name: open(os.path.join(folder, name)).read() for name in sorted(os.listdir(folder))}
    versions = {text.split()[0] for text in contents.values()}
    return versions.pop() if len(contents) == 2 and len(versions) == 1 else f"torn: {contents}"


def kill_at(monkeypatch, point):
    def fault(where):
        if where == point:
            raise Killed(where)

    monkeypatch.setattr(outputs, "_fault", fault)


@pytest.mark.parametrize("exchange,point", [(True, p) for p in EXCHANGE_POINTS] + [(False, p) for p in RENAME_POINTS])
def test_a_swap_killed_at_any_point_recovers_to_one_complete_version(tmp_path, monkeypatch, exchange, point):
    path = str(tmp_path / "export")
    write_version(path, "old")
    tmp = outputs.new_folder(path)
    write_version(tmp, "new")
    kill_at(monkeypatch, point)
    with pytest.raises(Killed):
        outputs.swap_in(tmp, path, exchange=exchange)
    if exchange:  # one step: at every moment the path holds a whole version
        assert version_of(path) in ("old", "new")
    monkeypatch.setattr(outputs, "_fault", lambda where: None)
    done = outputs.recover(path, exchange=exchange)
    # Once the new version was complete (.NAME.new) the swap is finished, never undone.
    assert version_of(path) == "new", done
    assert os.listdir(tmp_path) == ["export"]


def test_a_write_killed_before_its_folder_was_complete_keeps_the_old_version(tmp_path):
    path = str(tmp_path / "export")
    write_version(path, "old")
    tmp = outputs.new_folder(path)
    write_version(tmp, "new")
    os.remove(os.path.join(tmp, "config.json"))  # killed while writing
    assert "removed the unfinished" in outputs.recover(path)
    assert version_of(path) == "old" and os.listdir(tmp_path) == ["export"]


def test_leftovers_of_the_old_two_rename_swap_are_restored_and_removed(tmp_path):
    """Older versions of this code moved the export into .NAME.old-XXXX/old and the new one sat in .NAME.tmp-XXXX:
    a kill between the two renames left no export at all."""
    path = str(tmp_path / "export")
    write_version(str(tmp_path / ".export.old-ab12" / "old"), "old")
    write_version(str(tmp_path / ".export.tmp-cd34"), "new")
    outputs.recover(path)
    assert version_of(path) == "old" and os.listdir(tmp_path) == ["export"]


def test_swap_without_an_old_version_and_without_the_exchange(tmp_path):
    for exchange in (True, False):
        path = str(tmp_path / f"out{exchange}")
        tmp = outputs.new_folder(path)
        write_version(tmp, "new")
        outputs.swap_in(tmp, path, exchange=exchange)
        assert version_of(path) == "new"
        write_version(tmp := outputs.new_folder(path), "old")
        outputs.swap_in(tmp, path, exchange=exchange)
        assert version_of(path) == "old"
    assert sorted(os.listdir(tmp_path)) == ["outFalse", "outTrue"]


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_new_folders_and_their_files_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        tmp = outputs.new_folder(str(tmp_path / "out"))
        path = os.path.join(tmp, "model.safetensors")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)  # as tempfile-based writers create theirs
        os.close(fd)
        outputs.follow_umask(tmp)
        assert os.stat(tmp).st_mode & 0o777 == 0o777 & ~mask
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask
    finally:
        os.umask(old)


HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from bam import outputs
    outputs.lock(sys.argv[2], "OUT", "prepare_fineweb.py")
    print("locked", flush=True)
    time.sleep(60)
""")


def hold_lock(lock_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, ROOT, str(lock_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_lock_refuses_a_second_holder_naming_the_first_and_dies_with_it(tmp_path):
    lock_path = tmp_path / ".lock"
    proc = hold_lock(lock_path)
    try:
        with pytest.raises(outputs.InUse, match=rf"^OUT is in use by another prepare_fineweb.py \(pid {proc.pid}, host "):
            outputs.lock(str(lock_path), "OUT", "prepare_fineweb.py")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    key = outputs.lock(str(lock_path), "OUT", "prepare_fineweb.py")  # the kernel released it
    outputs.unlock(key)


def test_a_forked_worker_does_not_keep_its_parents_lock(tmp_path):
    key = outputs.lock(str(tmp_path / ".lock"), "OUT", "x")
    pid = os.fork()
    if pid == 0:  # the child: a worker that outlives its parent's lock
        time.sleep(5)
        os._exit(0)
    try:
        outputs.unlock(key)
        probe = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(60)", ""), ROOT, str(tmp_path / ".lock")],
                               capture_output=True, text=True, timeout=60)
        assert probe.stdout.strip() == "locked", probe.stderr
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_removable_lock_is_gone_after_its_holder_unlocks(tmp_path):
    path = str(tmp_path / ".export.lock")
    key = outputs.lock(path, "export", "export_hf.py", remove=True)
    assert os.path.exists(path)
    outputs.unlock(key)
    assert not os.path.exists(path)


def test_a_second_prepare_on_the_same_folder_is_refused_and_leaves_the_first_ones_temp_files(tmp_path):
    """The concurrent-prepare case: the second run used to delete every *.bin.tmp-* at start, including the file
    the first was writing."""
    import prepare_fineweb

    out = tmp_path / "demo"
    out.mkdir()
    writing = out / "demo_train_000001.bin.tmp-99999"
    writing.write_bytes(b"half a shard")
    key = prepare_fineweb.lock_out_dir(str(out))  # this process is the first run
    try:
        second = subprocess.run([sys.executable, "prepare_fineweb.py", "--source", "demo", "--out_dir", str(out),
                                 "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        outputs.unlock(key)
    assert second.returncode == 1
    assert second.stderr.strip().splitlines() == [
        f"error: {out} is in use by another prepare_fineweb.py (pid {os.getpid()}, host {os.uname().nodename})"]
    assert writing.read_bytes() == b"half a shard"
    assert sorted(p.name for p in out.iterdir()) == [".lock", writing.name]


def test_an_evaluator_removes_what_a_killed_one_left_and_refuses_a_concurrent_one(tmp_path):
    from bam.checkpoint import save_model
    from eval import EvalError
    from eval.options import EvalOptions
    from eval.passkey import evaluate_passkey
    from tiny_models import GPT2_VOCAB, tiny_model

    save_model(tiny_model(pe="rope", vocab_size=GPT2_VOCAB, block_size=64), str(tmp_path / "m.pt"))
    out = tmp_path / "results"
    out.mkdir()
    (out / "passkey.json.tmp-4242").write_text("{half")
    (out / "passkey.png.tmp-4242").write_bytes(b"\x89PNG half")
    (out / "niah.json.tmp-4242").write_text("{another evaluator's}")
    options = EvalOptions(out=str(out), progress=False, verbose=False)
    evaluate_passkey(str(tmp_path / "m.pt"), options=options, lengths=[80], samples=2)
    assert sorted(p.name for p in out.iterdir()) == ["niah.json.tmp-4242", "passkey.json", "passkey.png"]
    assert json.loads((out / "passkey.json").read_text())["complete"]

    proc = hold_lock(out / ".passkey.lock")
    try:
        with pytest.raises(EvalError, match=r"passkey.json is in use by another eval.passkey \(pid \d+"):
            evaluate_passkey(str(tmp_path / "m.pt"), options=options, lengths=[80], samples=2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


class Refused(Exception):
    pass


def test_check_replaceable_passes_only_a_folder_its_manifest_lists_whole(tmp_path):
    """What --overwrite may replace: an empty folder, or one whose manifest names the command and lists every
    entry (entries it lists but lacks are no loss). A folder without the manifest, with another command's, with
    more than it lists, a file or a link: one line each, the folder's contents named by the folder."""
    def check(path, older=None):
        outputs.check_replaceable(str(path), "made.json", "make.py", Refused, "OUT", older=older)

    def refusal(path, older=None):
        with pytest.raises(Refused) as e:
            check(path, older)
        assert "\n" not in str(e.value)
        return str(e.value)

    (tmp_path / "empty").mkdir()
    check(tmp_path / "empty")
    made = tmp_path / "made"
    (made / "tokenizer").mkdir(parents=True)
    (made / "weights.bin").write_bytes(b"w")
    (made / "tokenizer" / "vocab.json").write_text("{}")
    outputs.write_manifest(str(made), "made.json", {"written_by": "make.py"})
    assert json.loads((made / "made.json").read_text())["files"] == ["tokenizer/", "tokenizer/vocab.json",
                                                                       "weights.bin"]
    check(made)
    (made / "weights.bin").unlink()
    check(made)
    (made / "notes.md").write_text("mine")
    (made / "tokenizer" / "merges.txt").write_text("")
    (made / "eval" / "deep").mkdir(parents=True)
    (made / "eval" / "deep" / "passkey.json").write_text("{}")
    assert f"OUT {made} holds what make.py did not write: eval/, notes.md, tokenizer/merges.txt;" in refusal(made)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "made.json").write_text(json.dumps({"written_by": "other.py", "files": ["made.json"]}))
    assert "is not a folder make.py wrote (no made.json of it)" in refusal(foreign)
    assert "looks like the output of an earlier make.py" in refusal(foreign, older=lambda path: True)
    (foreign / "made.json").write_text("not json")
    assert "is not a folder make.py wrote" in refusal(foreign)
    (tmp_path / "file").write_text("x")
    assert "exists and is not a folder" in refusal(tmp_path / "file")
    os.symlink(made, tmp_path / "link")
    assert "is a symbolic link" in refusal(tmp_path / "link")
