"""The run's /workspace on the host side, and the one way files leave it.

Everything in the workspace was written by untrusted code. It may hold symlinks to host
files, FIFOs that block a reader, directories chmod-ed to 0, names with terminal escape
sequences or invalid UTF-8, and trees deeper than Python's recursion limit. So:

- files are listed and read only through directory fds, with ``O_NOFOLLOW`` on every
  component, and only when ``fstat`` says "regular file"; reads are bounded (`fds`);
- names are neutralised before they reach a result, a log or a terminal;
- S_ISUID and S_ISGID are taken off everything in a workspace the user keeps
  (`privileges`);
- removal walks the tree itself, fd-based and iteratively, whatever its depth
  (`lifecycle`).

One concern a module: `lifecycle` (create, use, destroy; the private parent of run
directories and its sweep; a ``--workspace DIR``'s own mode), `listing` (what a run left:
paths, sizes, hashes, MIME types), `privileges` (setuid/setgid bits), `files` (uploads in,
`read_file` out), `ownership` (a lent directory given to the sandbox's host id and
back). The size-limited tmpfs itself is `codecage.isolation.tmpfs`. What the
layers above use is named here.
"""

from codecage.engine.workspace import ownership
from codecage.engine.workspace.fds import MAX_DEPTH
from codecage.engine.workspace.files import check_files, keep, read_file, write_files
from codecage.engine.workspace.lifecycle import (
    RootState,
    Workspace,
    create_ephemeral,
    destroy,
    entry_names,
    private_parent,
    restore_root,
    run_dir_mode,
    save_root,
    sweep_stale,
    use_existing,
)
from codecage.engine.workspace.listing import list_files
from codecage.engine.workspace.privileges import strip_privilege_bits

__all__ = [
    "MAX_DEPTH",
    "RootState",
    "Workspace",
    "check_files",
    "create_ephemeral",
    "destroy",
    "entry_names",
    "keep",
    "list_files",
    "ownership",
    "private_parent",
    "read_file",
    "restore_root",
    "run_dir_mode",
    "save_root",
    "strip_privilege_bits",
    "sweep_stale",
    "use_existing",
    "write_files",
]
