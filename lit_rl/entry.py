"""The `lit-rl` console script: check the installation, then run the CLI (`lit_rl.cli.main`), or `lit-rl check`
(`lit_rl.check`) or `lit-rl export` (`lit_rl.export`).

The check runs before anything imports Lightning: a broken `torchvision` fails `import lightning` itself
(torchmetrics imports it), so the CLI module could not even load to report it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable, Optional

from lit_rl.errors import BrokenInstall

INSTALL_ERROR_EXIT = 1


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
