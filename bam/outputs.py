"""
The outputs commands write, made safe against a second command and against a kill at any moment. The one
module that puts files and folders into place: every file the repository writes for keeps (checkpoints,
shards, manifests, metrics, eval results) goes through atomic_file, every folder through swap_in.

    atomic_file(path)           a file object whose content replaces `path` only once the block ends: a temp
                                file beside it, fsync, rename, fsync of the directory; a crash leaves the
                                previous file or the complete new one, never a torn one (write_bytes,
                                write_text); a failed write is one cli.WriteError line naming `path`
    check_writable(folder)      the OSError a later write would meet, now, before the work
    remove_temp_files(folder)   temp files and folder swaps of killed writers (call it holding the lock)
    write_failure(error, path)  the OSError behind a library's failed write (torch.save, DCP, safetensors)
    set_aside(path, suffix)     rename a file or folder out of every reader's way (*.rejected, *.damaged)

    lock(path, what, command)   an flock held while a command writes an output (train.py's run dir,
                                prepare_fineweb.py's --out_dir, an export, an evaluator's results file); a
                                second command is refused in one line naming the holder, and the kernel
                                releases the lock however the holder ends (also SIGKILL)
    new_folder(path)            the folder to write a new version of `path` into, beside it (.NAME.tmp-*)
    swap_in(tmp, path)          put the finished folder at `path`, replacing an old one
    recover(path)               what a killed swap_in or writer of `path` left: finished or undone, and
                                every leftover removed (call it holding the lock, before writing)
    locked_folder(folder, ...)  FOLDER/.lock for a block; a refused command leaves no folder it made
    claim_folder(path, ...)     .NAME.lock beside an output folder, then recover(path) (export, import)
    check_apart(source, out)    refuse an output that is its source, holds it or lies inside it (symlinks
                                resolved), before anything is written
    write_manifest(folder, ...) FOLDER/NAME listing every entry of a finished folder, and who wrote it
    check_replaceable(path,...) refuse to replace a folder unless it is empty or its manifest names the
                                command and lists all it holds (what --overwrite may replace)
    remove_stale(folder, glob)  temp files of killed writers (their rename never happened)

How a folder is swapped (docs/INTERFACES.md, "Outputs after a kill"). A folder cannot be renamed over a
non-empty one, so the new version is written to .NAME.tmp-PID-*, renamed to .NAME.new once complete (a
.NAME.new is always whole), then exchanged with NAME in one step by renameat2(RENAME_EXCHANGE), which
Linux has on local file systems; the old version, now at .NAME.new, is removed. A journal, .NAME.swap,
written before the exchange, holds the inode of the new folder, so that `recover` can tell a .NAME.new
that still waits to be swapped in (its inode) from the old one swapped out (another inode). Where the
exchange is not supported (NFS, old kernels) the old folder is renamed to .NAME.old first and the new one
into place after: a kill between the two renames leaves no NAME for a moment, and `recover` finishes the
swap (.NAME.new is whole) or, without a .NAME.new, puts .NAME.old back. Either way, after `recover`, NAME
holds the old complete folder or the new complete one, and nothing else of the swap is left.

Everything is created with the user's umask, as any file the user writes (no 0700 temp folders).
"""

import atexit
import ctypes
import errno
import fcntl
import glob
import json
import os
import re
import resource
import secrets
import shutil
import socket
import sys
import tempfile
from contextlib import contextmanager

from bam.cli import WriteError


class InUse(Exception):
    """Another process holds the lock of an output."""


_HELD = {}  # lock file -> open file, for every lock this process holds


def lock(lock_path, what, command, remove=False):
    """Lock `lock_path` (created if needed; its folder must exist) for the rest of the process or until
    unlock(); InUse "WHAT is in use by another COMMAND (pid N, host H)" if another process holds it. The
    file holds the holder's line for the next one to name. With `remove`, unlock() deletes it (a lock beside
    an export should not stay there); a process that locked a file just deleted sees that its inode is no
    longer the one at the path and tries again, so two can never both hold it."""
    key = os.path.abspath(lock_path)
    if key in _HELD:
        return key  # this process holds it already (a command that locks, then calls a function that locks)
    while True:
        f = open(key, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "pid unknown"
            f.close()
            raise InUse(f"{what} is in use by another {command} ({holder})") from None
        except BaseException:
            f.close()
            raise
        try:
            if os.stat(key).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()  # removed by its holder as we locked it: lock the file that is there now
    f.truncate(0)
    f.write(f"pid {os.getpid()}, host {socket.gethostname()}\n")
    f.flush()
    _HELD[key] = (f, remove)
    if remove:
        atexit.register(unlock, key)  # also when the command ends on an error; a kill leaves it to the next holder
    return key


def unlock(lock_path):
    key = os.path.abspath(lock_path)
    f, remove = _HELD.pop(key, (None, False))
    if f is not None:
        if remove:
            try:
                os.remove(key)  # while still holding it; see lock()
            except FileNotFoundError:
                pass
        f.close()  # releases the flock


@contextmanager
def locked_folder(folder, lock_name, what, command, refused=InUse):
    """Hold FOLDER/LOCK_NAME (lock) for the block, creating FOLDER if needed; `refused` (the caller's error
    type, InUse by default) with lock's line if another process holds it. A command refused before it wrote anything (an exception out of the block while the lock is all the
    folder holds) leaves no folder behind if it made it. The lock file stays otherwise: removing it would
    race with a process about to lock it."""
    created = not os.path.exists(folder)
    os.makedirs(folder, exist_ok=True)
    try:
        key = lock(os.path.join(folder, lock_name), what, command)
    except InUse as e:
        raise refused(str(e)) from None
    try:
        yield key
    except BaseException:
        if created and os.listdir(folder) == [lock_name]:
            unlock(key)
            os.remove(os.path.join(folder, lock_name))
            os.rmdir(folder)
        raise
    finally:
        unlock(key)


def claim_folder(path, command, what, refused=InUse):
    """Hold .NAME.lock beside the output folder `path` for the rest of the command (removed when it ends),
    then finish or undo what a killed `command` writing `path` left (recover), saying so in one note:
    "COMMAND: PATH: a killed WHAT was cleaned up: ...". `refused` (the caller's error type) if another
    process holds the lock."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        lock(sibling(path, "lock"), path, command, remove=True)
    except InUse as e:
        raise refused(str(e)) from None
    done = recover(path)
    if done:
        print(f"{command}: {path}: a killed {what} was cleaned up: {done}", file=sys.stderr)


def check_apart(source, out, refused=ValueError, source_name="SRC", out_name="OUT"):
    """Refuse, as `refused` (the caller's error type) with one line naming both, an output `out` that is
    `source`, contains it or lies inside it, both resolved (os.path.realpath: symlinks followed, a part of
    `out` not made yet kept as written). Swapping in such an output removes the source (it replaces the
    folder that holds it), and writing it puts the command's files into the user's source folder. Call it
    before anything is written."""
    src, dst = os.path.realpath(source), os.path.realpath(out)
    relation = "is" if dst == src else "contains" if _inside(src, dst) else \
        "lies inside" if _inside(dst, src) else None
    if relation is None:
        return
    given = (os.path.abspath(source), os.path.abspath(out))
    resolved = f" (resolved: {out_name} {dst}, {source_name} {src})" if given != (src, dst) else ""
    raise refused(f"{out_name} {out} {relation} {source_name} {source}{resolved}: an output and its source must "
                  f"lie apart, neither inside the other; choose another {out_name}")


def contents(folder):
    """Every file, link and folder under `folder` as a path relative to it, "/"-separated, a folder's ending in
    "/" (a link is never followed), sorted. A folder that cannot be read is an OSError: what cannot be listed
    cannot be vouched for."""
    def fail(error):
        raise error

    found = []
    for root, dirs, files in os.walk(folder, onerror=fail):
        rel = os.path.relpath(root, folder)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        found += [prefix + name + ("" if os.path.islink(os.path.join(root, name)) else "/") for name in dirs]
        found += [prefix + name for name in files]
    return sorted(found)


def write_manifest(folder, name, record):
    """FOLDER/NAME: `record` (with "written_by", the command) and "files", every entry of `folder` (contents)
    but NAME itself. Write it last, into the finished folder before it is swapped in: check_replaceable later
    replaces the folder only while it holds nothing more."""
    files = [entry for entry in contents(folder) if entry != name]
    write_text(os.path.join(folder, name), json.dumps({**record, "files": files}, indent=1) + "\n")


def check_replaceable(path, name, command, refused, option, older=None):
    """Refuse, as `refused` (the caller's error type) with one line, to replace the existing `path` unless it is
    an empty folder or a folder that `command` wrote: its manifest NAME (write_manifest) names `command` and
    lists every entry the folder holds. A folder holding anything else (a user's notes, evaluation results, a
    checkout whose files share names with the command's) is refused naming what is extra, and nothing is
    removed. `older(path)`: whether the folder looks like one an earlier version of `command` wrote without a
    manifest, which is refused too (nothing can tell what was added to it since), with a hint. `option`: how
    the command line names `path` (OUT_DIR)."""
    def refuse(why):
        raise refused(f"{option} {path} {why}")

    if os.path.islink(path):
        refuse(f"is a symbolic link; --overwrite replaces only a folder {command} wrote, not a link to one: give "
               f"{os.path.realpath(path)}, or choose another {option}")
    if not os.path.isdir(path):
        refuse(f"exists and is not a folder; choose another {option}")
    try:
        if not os.listdir(path):
            return  # nothing to lose
        with open(os.path.join(path, name), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):  # none, unreadable or not JSON: not a manifest this command wrote
        manifest = None
    listed = manifest.get("files") if isinstance(manifest, dict) and manifest.get("written_by") == command \
        else None
    if not isinstance(listed, list) or not all(isinstance(entry, str) for entry in listed):
        if older is not None and older(path):
            refuse(f"looks like the output of an earlier {command}, which did not list the files it wrote in "
                   f"{name}, so nothing tells what was added to it since; --overwrite replaces only a folder that "
                   f"lists them: check it and remove it yourself, or choose another {option}")
        refuse(f"is not a folder {command} wrote (no {name} of it); --overwrite replaces only those, so nothing "
               f"was removed: choose another {option}")
    try:
        found = contents(path)
    except OSError as e:
        refuse(f"cannot be listed ({e.strerror or e}: {e.filename}); --overwrite replaces only a folder {command} "
               f"wrote, checked entry by entry")
    extra, inside = [], None
    for entry in sorted(set(found) - set(listed) - {name}):
        if inside and entry.startswith(inside):
            continue  # named by its folder (sorted: a folder's entries follow it)
        extra.append(entry)
        inside = entry if entry.endswith("/") else None
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        refuse(f"holds what {command} did not write: {', '.join(extra[:5])}{more}; --overwrite replaces only a "
               f"folder holding nothing else, so nothing was removed: move those away, or choose another {option}")


def _inside(path, folder):
    """Whether `path` lies strictly inside `folder` (resolved paths, compared by component)."""
    return path != folder and os.path.commonpath([path, folder]) == folder


def _forget_in_child():
    """A forked child (a tokenizer worker, a data loader worker) must not keep its parent's locks: flock
    belongs to the open file, which the child shares, so a worker outliving a killed parent would still hold
    it. Closing the child's copy leaves the parent's lock as it is."""
    for f, _ in _HELD.values():
        f.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def sibling(path, kind):
    """.NAME.<kind> beside `path`: where its swap keeps a new or old version, its journal, its lock."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{kind}")


def umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def new_folder(path):
    """An empty folder beside `path` (same file system, so the swap is a rename), with the umask's mode."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{sibling(path, 'tmp')}-{os.getpid()}-{secrets.token_hex(3)}"
    os.mkdir(tmp)
    return tmp


def follow_umask(folder):
    """Give every folder and file under `folder` the mode the umask gives a new one (a library may have
    written some with tempfile's 0600); executable bits are kept only on folders."""
    mask = umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _fault(point):
    """Where a test injects a kill between two steps of a swap (tests/test_outputs.py); nothing otherwise."""


def swap_in(tmp, path, exchange=True):
    """Put the complete folder `tmp` (from new_folder) at `path`, replacing what is there. A kill at any point
    leaves, once recover(path) has run, the old complete folder at `path` or the new one."""
    new = sibling(path, "new")
    os.rename(tmp, new)  # from here on, the new version is whole and recover() will put it in place
    fsync_dir(os.path.dirname(new))
    _fault("complete")
    _put_new_in_place(new, path, exchange)


def _put_new_in_place(new, path, exchange):
    parent, journal = os.path.dirname(new), sibling(path, "swap")
    if not os.path.lexists(path):
        os.rename(new, path)
        fsync_dir(parent)
        return
    if exchange:
        _write_journal(journal, os.stat(new).st_ino)
        _fault("journal")
        try:
            _exchange(new, path)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            os.remove(journal)  # not supported here: the two renames below instead
        else:
            fsync_dir(parent)
            _fault("exchanged")
            shutil.rmtree(new)  # the old version, swapped out
            _fault("old removed")
            os.remove(journal)
            return
    old = sibling(path, "old")
    os.rename(path, old)
    _fault("old aside")
    os.rename(new, path)
    fsync_dir(parent)
    _fault("new in place")
    shutil.rmtree(old)


def recover(path, exchange=True):
    """Finish or undo the swap of `path` that a killed process left, and remove its leftovers: temp folders
    of unfinished writes (.NAME.tmp-*), a whole new version waiting (.NAME.new: swapped in), the old one
    (.NAME.old, .NAME.new after the exchange: removed, or put back when nothing else is at `path`), the
    journal, and the .NAME.old-*/.NAME.tmp-* folders of older versions of this code. Returns what it did, in
    words (for a note on stderr), or "" when there was nothing to do. Hold the output's lock."""
    done = []
    new, old, journal = sibling(path, "new"), sibling(path, "old"), sibling(path, "swap")
    for stale in glob.glob(glob.escape(sibling(path, "tmp")) + "-*"):
        _remove(stale)
        done.append(f"removed the unfinished {os.path.basename(stale)}")
    for stale in glob.glob(glob.escape(journal) + ".tmp-*"):
        _remove(stale)
    for legacy in glob.glob(glob.escape(sibling(path, "old")) + "-*"):  # replace_dir of older versions
        if not os.path.lexists(path) and os.path.isdir(os.path.join(legacy, "old")):
            os.rename(os.path.join(legacy, "old"), path)
            done.append("put the previous version back")
        _remove(legacy)
    if os.path.lexists(old):
        if not os.path.lexists(path):
            if os.path.isdir(new):
                os.rename(new, path)
                done.append("finished swapping in the new version")
            else:
                os.rename(old, path)
                done.append("put the previous version back")
        if os.path.lexists(old):
            _remove(old)
    if os.path.isdir(new):
        swapped_out = os.path.exists(journal) and _read_journal(journal) != os.stat(new).st_ino
        if swapped_out:
            _remove(new)
            done.append("removed the previous version")
        else:
            _put_new_in_place(new, path, exchange)
            done.append("finished swapping in the new version")
    if os.path.lexists(journal):
        os.remove(journal)
    if os.path.lexists(path) or done:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return "; ".join(done)


def remove_stale(folder, pattern):
    """Remove what matches `pattern` in `folder` (temp files named NAME.tmp-PID of killed writers). Call it
    holding the lock of whatever writes them, so no live writer's file is taken."""
    removed = []
    for stale in glob.glob(os.path.join(glob.escape(folder), pattern)):
        _remove(stale)
        removed.append(stale)
    return removed


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _write_journal(journal, inode):
    tmp = f"{journal}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{inode}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, journal)
    fsync_dir(os.path.dirname(journal))


def _read_journal(journal):
    try:
        with open(journal) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # a journal cut short was written before the exchange: the new folder is still new


def _exchange(a, b):
    """renameat2(a, b, RENAME_EXCHANGE): the two paths trade places in one step (Linux >= 3.15, glibc >= 2.28)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None or not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, "renameat2 is not available", a)
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a, None, b)


def fsync_dir(directory):
    """Make a rename or a new entry in `directory` durable (the entry is on disk only once it is synced)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------
# Atomic writes of files


@contextmanager
def atomic_file(path, mode="wb"):
    """A file object to write `path`'s new content into; it replaces `path` only once the block ends
    without an exception (an exception leaves the old file and no temp file). An OSError of the write
    itself (a full disk, a read-only folder, a file where the folder should be) comes out as cli.WriteError:
    one line that names `path`, not the temp file, and says that the previous `path` is unchanged."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # The pid keeps two processes that write the same file (e.g. every torchrun rank fetching the
    # tokenizer) from writing into one temp file.
    tmp = f"{path}.tmp-{os.getpid()}"
    renamed = False
    try:
        os.makedirs(directory, exist_ok=True)
        try:
            with open(tmp, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            renamed = True
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        fsync_dir(directory)  # the rename itself is only durable once the directory entry is on disk
    except WriteError:
        raise  # a nested atomic write already said which file
    except OSError as e:
        if not _is_about(e, path, tmp, directory):
            raise  # the block failed reading some other file: that file is what the error is about
        if renamed:  # only the folder's fsync failed: the new file is in place, perhaps not yet durable
            raise WriteError(e, path, "the new file is in place but may not survive a power loss") from e
        kept = "its previous version is unchanged" if os.path.isfile(path) else "nothing was written"
        raise WriteError(e, path, kept) from e


def _is_about(error, path, tmp, directory):
    """Whether an OSError is about writing `path`: it names no file, or the file, its temp file, or a folder on
    the way to it (which makedirs could not create)."""
    if error.filename is None:
        return True
    name = os.path.abspath(os.fsdecode(error.filename))
    return name in (os.path.abspath(path), os.path.abspath(tmp)) or (directory + os.sep).startswith(name + os.sep)


def check_writable(directory):
    """Create `directory` if needed and write and delete a probe file in it: the OSError a later write would
    meet (read-only, a file in the way, no permission) comes now, before any work whose results it would
    take. (Root ignores permission bits, so only trying tells.) Folders it had to create are removed again,
    so a command refused later leaves nothing behind; the real write creates them."""
    missing = missing_folder(directory)
    os.makedirs(directory, exist_ok=True)
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    finally:
        if missing:
            shutil.rmtree(missing, ignore_errors=True)
    return directory


def missing_folder(directory):
    """The outermost folder that os.makedirs(directory) would create, or None when `directory` exists."""
    missing = os.path.abspath(directory)
    if os.path.exists(missing):
        return None
    while not os.path.exists(os.path.dirname(missing)) and os.path.dirname(missing) != missing:
        missing = os.path.dirname(missing)
    return missing


def remove_empty_folders(directory, up_to):
    """Remove `directory` and the folders above it up to `up_to` (a folder above it, or itself), each only
    while it is empty: what makedirs made for a command that then wrote nothing."""
    path, up_to = os.path.abspath(directory), os.path.abspath(up_to)
    while (path + os.sep).startswith(up_to + os.sep):
        try:
            os.rmdir(path)
        except OSError:  # not empty (someone else's files), or gone already
            return
        path = os.path.dirname(path)


def write_bytes(path, chunks):
    """Write an iterable of bytes objects to `path` atomically."""
    with atomic_file(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)


def write_text(path, text):
    with atomic_file(path, "w") as f:
        f.write(text)


def remove_temp_files(directory):
    """Temp files (and sharded checkpoint folders) of writes that were killed before their rename, which
    nothing else ever reads, and the swap of a folder (best/) that a kill interrupted, finished or undone
    (recover). The caller holds the lock of the folder."""
    for stale in glob.glob(os.path.join(glob.escape(directory), "*.tmp-*")):
        if os.path.isdir(stale):
            shutil.rmtree(stale)
        else:
            os.remove(stale)
    for kind in ("new", "old", "swap"):
        for left in glob.glob(os.path.join(glob.escape(directory), f".*.{kind}")):
            recover(os.path.join(directory, os.path.basename(left)[1:-len(kind) - 1]))


def set_aside(path, suffix):
    """Rename `path` (a file or folder) to PATH + suffix, which no reader matches (a checkpoint rejected after
    a loss spike: step_X.pt.rejected), durably. Returns the new path."""
    os.replace(path, path + suffix)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return path + suffix


def write_failure(error, path):
    """The OSError behind `error` when it is a failed write, else None. Libraries that write for us hide the
    OSError: torch.save's zip writer raises a RuntimeError ("unexpected pos ...") with the OSError as its
    context, or none at all once it crossed processes (torch.distributed.checkpoint gathers every rank's
    failure by pickling it), and safetensors raises its own error that names the errno ("os error 27") in its
    text. Without an errno left to read, the file system at `path` is asked: a file-size limit (ulimit -f)
    or a full disk says which; otherwise it is an input/output error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            return error
        text = str(error)
        found = re.search(r"os error (\d+)", text)
        if found:
            return OSError(int(found[1]), os.strerror(int(found[1])), os.fspath(path))
        if "unexpected pos" in text or "inline_container" in text:
            return OSError(_likely_errno(path), os.strerror(_likely_errno(path)), os.fspath(path))
        error = error.__cause__ or error.__context__
    return None


def _likely_errno(path):
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return errno.EFBIG
    try:
        folder = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        if shutil.disk_usage(folder).free < 1 << 20:
            return errno.ENOSPC
    except OSError:
        pass
    return errno.EIO
