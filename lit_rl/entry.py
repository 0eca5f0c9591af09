"""The `lit-rl` console script: check the installation, then run the CLI (`lit_rl.cli.main`), or `lit-rl check`
(`lit_rl.check`) or `lit-rl export` (`lit_rl.export`).

The check runs before anything imports Lightning: a broken `torchvision` fails `import lightning` itself
(torchmetrics imports it), so the CLI module could not even load to report it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable, Optional

from lit_rl.errors import BrokenInstall

INSTALL_ERROR_EXIT = 1
UMASK_ENV = "LIT_RL_UMASK"
PRIVATE_UMASK = "077"


def private_files() -> None:
    """What a run writes (run folders, metrics, checkpoints, exports, weight files for the server) is its user's
    alone: the process's umask is 077 (folders 0700, files 0600), or `LIT_RL_UMASK` (027: the group reads them too;
    docs/security.md). Processes it starts (ranks, the vLLM server) inherit it."""
    value = os.environ.get(UMASK_ENV, PRIVATE_UMASK)
    try:
        mask = int(value, 8)
    except ValueError:
        mask = -1
    if not 0 <= mask <= 0o777 or mask & 0o022 != 0o022:  # others may never write into a run's files
        sys.stderr.write(
            f"lit-rl: error: {UMASK_ENV}={value!r} is not an octal umask that keeps a run's files from being "
            "written by others, such as 077, 027 or 022\n"
        )
        sys.exit(INSTALL_ERROR_EXIT)
    os.umask(mask)


def check_vision_packages(import_module: Callable[[str], object] = importlib.import_module) -> None:
    """Fail in one line when an installed `torchvision` cannot load against this torch.

    The CPU build of vLLM pulls `torchvision` (with `torchaudio` and `torchcodec`) built for another torch;
    importing it then fails (`operator torchvision::nms does not exist`), and torchmetrics and transformers import
    it whenever it is installed. lit-rl uses none of them: the fix is to remove them.
    """
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import_module("torchvision")
    except (RuntimeError, ImportError, OSError) as err:
        import torch

        raise BrokenInstall(
            f"the installed torchvision does not load with torch {torch.__version__} ({err}); lit-rl does not "
            "use it: remove it with `pip uninstall -y torchvision torchaudio torchcodec`"
        ) from err


def main(args: Optional[list[str]] = None) -> None:
    if args is None:  # the console script (a test calling `main([...])` keeps its own process's umask)
        private_files()
    try:
        check_vision_packages()
    except BrokenInstall as err:
        sys.stderr.write(f"lit-rl: error: {err}\n")
        sys.exit(INSTALL_ERROR_EXIT)
    given = sys.argv[1:] if args is None else args
    if given[:1] == ["check"]:  # `lit-rl check`: not a LightningCLI subcommand (lit_rl/check)
        from lit_rl.check.command import main as check_main

        check_main(given[1:])
        return
    if given[:1] == ["export"]:  # `lit-rl export CKPT OUT`: a checkpoint as a save_pretrained folder (lit_rl/export.py)
        from lit_rl.export import main as export_main

        export_main(given[1:])
        return
    from lit_rl.cli import main as cli_main

    cli_main(args)
