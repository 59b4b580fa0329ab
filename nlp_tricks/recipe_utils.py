"""Small pieces shared by the scripts in ``recipes/``: argument parsing, one-line data errors, model loading, results.

Each recipe stays one readable script; what is here is what all three would otherwise repeat.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser

from .checkpoint import load_state_dict_portable
from .data import DataError, demo_model_path

__all__ = [
    "STATE_DICT_SUFFIXES",
    "parse_recipe_args",
    "run_recipe",
    "resolve_model_path",
    "load_config_and_tokenizer",
    "load_weights",
    "write_json_atomic",
    "is_main_process",
]

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def is_main_process() -> bool:
    """Rank 0 of a launched job (or a plain run), read from the launcher's environment without any collective."""
    return int(os.environ.get("RANK", "0")) == 0


def parse_recipe_args(
    dataclass_types: tuple, recipe: str, defaults: dict | None = None, argv: list[str] | None = None
):
    """Parse the command line (or one ``.yaml`` / ``.json`` file given as the only argument) into the dataclasses.

    ``defaults`` replace the dataclasses' own defaults (e.g. the recipe's learning rate); ``output_dir`` defaults to
    ``outputs/<recipe>`` and ``report_to`` to ``none``. A value the arguments reject (``ValueError`` from a
    ``__post_init__``) prints one line and exits with status 2, as argparse does for a bad flag.
    """
    argv = sys.argv[1:] if argv is None else argv
    defaults = {"output_dir": f"outputs/{recipe}", "report_to": "none", **(defaults or {})}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        # A launched multi-process job without GPUs (`accelerate launch --multi_gpu` on CPUs): accelerate forms the
        # CPU (gloo) process group only with use_cpu; without it every process would train alone on all the data.
        defaults.setdefault("use_cpu", True)
    parser = HfArgumentParser(dataclass_types)
    parser.prog = f"{recipe}.py"
    try:
        if len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json")):
            path = Path(argv[0])
            if path.suffix == ".json":
                values = json.loads(path.read_text(encoding="utf-8"))
            else:
                import yaml

                values = yaml.safe_load(path.read_text(encoding="utf-8"))
            if not isinstance(values, dict):
                parser.error(f"{path}: expected a mapping of argument names to values")
            return parser.parse_dict({**defaults, **values})
        parser.set_defaults(**defaults)
        return parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:
        parser.error(str(err).splitlines()[0] if str(err) else type(err).__name__)


def run_recipe(main: Callable[[], None]) -> None:
    """Run ``main``; a :class:`~nlp_tricks.data.DataError` ends it with one line on stderr and exit status 1.

    Only rank 0 prints, so a launched job with N processes shows the line once. Nothing else is caught: a bug keeps
    its traceback.
    """
    try:
        main()
    except DataError as err:
        if is_main_process():
            print(str(err), file=sys.stderr, flush=True)
        sys.exit(1)


def resolve_model_path(model_name_or_path: str | None) -> str:
    """The model to start from: the given path or hub id, or the demo's MiniLM encoder when none is given."""
    return model_name_or_path or demo_model_path()


def _is_state_dict_file(path: str) -> bool:
    return path.endswith(STATE_DICT_SUFFIXES) and os.path.isfile(path)


def load_config_and_tokenizer(
    model_name_or_path: str,
    tokenizer_name: str | None = None,
    trust_remote_code: bool = False,
    **config_kwargs,
):
    """The config and tokenizer of ``model_name_or_path``.

    A raw state-dict file (``.pt`` / ``.pth`` / ``.bin`` / ``.safetensors``) has neither: its architecture and
    tokenizer are the demo model's (or ``tokenizer_name``'s), and :func:`load_weights` loads the file into it.
    """
    source = demo_model_path() if _is_state_dict_file(model_name_or_path) else model_name_or_path
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **config_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or source, trust_remote_code=trust_remote_code)
    return config, tokenizer


def load_weights(auto_cls, model_name_or_path: str, config, trust_remote_code: bool = False):
    """``auto_cls.from_pretrained``; for a raw state-dict file, the model built from ``config`` with its weights."""
    if _is_state_dict_file(model_name_or_path):
        # Any checkpoint (DataParallel / DDP / compiled prefixes), any device, strict, with clear errors.
        model = auto_cls.from_config(config, trust_remote_code=trust_remote_code)
        load_state_dict_portable(model, model_name_or_path)
        return model
    return auto_cls.from_pretrained(model_name_or_path, config=config, trust_remote_code=trust_remote_code)


def resume_argument(value: str | None) -> str | bool | None:
    """``--resume_from_checkpoint``: ``true`` means the newest complete checkpoint in output_dir, else a path."""
    if value is not None and value.strip().lower() in ("true", "yes", "1"):
        return True
    return value or None


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write ``data`` as JSON through a temporary file and a rename, so a reader never sees a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
