"""Cold start: what `llmrt --help` and the generate path import, and the transformers-free tokenizer."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmrt.tokenizer import load_tokenizer
from llmrt.tokenizer_files import RustTokenizerFiles

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "llmrt" / "data" / "stories260K"
FIXTURES = ROOT / "tests" / "fixtures" / "tokenizers"
HEAVY = ("transformers", "xgrammar", "fastapi", "uvicorn", "matplotlib", "httpx", "jinja2", "torch._dynamo")


def _modules_after(code: str) -> set[str]:
    """The top-level modules (and torch._dynamo) a fresh interpreter holds after running `code`."""
    probe = code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_help_imports_no_torch_and_no_heavy_library():
    mods = _modules_after("from llmrt.cli import build_parser\nbuild_parser([]).format_help()")
    assert not {m for m in ("torch", *HEAVY) if m in mods}


def test_generate_path_imports_only_what_the_first_token_needs():
    mods = _modules_after("from llmrt.cli import main\n"
                          "main(['generate', '--prompt', 'Once upon', '--max-tokens', '3', '--temperature', '0'])")
    assert "torch" in mods and "tokenizers" in mods  # the probe really ran the engine
    assert not {m for m in HEAVY if m in mods}, {m for m in HEAVY if m in mods}


def test_generate_command_exits_without_teardown_and_loses_nothing():
    """`llmrt generate` as a process ends right after its text (no interpreter teardown): the streamed text is
    whole on a pipe, the same as the in-process engine's, and errors keep their exit code."""
    from llmrt import LLM, SamplingParams

    cmd = [sys.executable, "-m", "llmrt.cli", "generate", "--prompt", "Once upon", "--max-tokens", "12",
           "--temperature", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    text = LLM().generate(["Once upon"], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert out.stdout == "Once upon" + text + "\n"
    bad = subprocess.run([sys.executable, "-m", "llmrt.cli", "generate", "/nonexistent", "--prompt", "x"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "model_load_error" in bad.stderr


TEXTS = ["Once upon a time", "def hello(x):\n    return x + 1  # héllo 🦙", "  two  spaces\tand a tab", "</s> in text",
         "\u00e9\u00e8 \u4e2d\u6587 \U0001f600"]


@pytest.mark.parametrize("path", [EMBEDDED, FIXTURES / "phi3", FIXTURES / "gpt2"], ids=lambda p: p.name)
def test_rust_tokenizer_matches_transformers_where_it_is_used(path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    fast = RustTokenizerFiles.open(str(path))
    if path == EMBEDDED:
        assert fast is not None  # the embedded model's first token must not wait for transformers
    if fast is None:
        assert load_tokenizer(str(path))._base.__class__.__module__.startswith("transformers")
        return
    tok = load_tokenizer(str(path))
    assert tok._base is not None and isinstance(tok._base, RustTokenizerFiles)
    assert (len(fast), fast.bos_token_id, fast.eos_token_id, fast.unk_token_id) == \
        (len(hf), hf.bos_token_id, hf.eos_token_id, hf.unk_token_id)
    assert tok.special_ids == frozenset(i for i, t in hf.backend_tokenizer.get_added_tokens_decoder().items()
                                        if t.special)
    assert fast.chat_template == hf.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == ids, (text, special)
            assert tok.decode(ids, skip_special_tokens=special) == hf.decode(ids, skip_special_tokens=special)
    pieces = [f"<0x{b:02X}>" for b in range(4)] + ["surely-not-a-token"]
    assert fast.convert_tokens_to_ids(pieces) == hf.convert_tokens_to_ids(pieces)
    assert fast.convert_ids_to_tokens([5, 6, 7]) == hf.convert_ids_to_tokens([5, 6, 7])
    assert tok.hf.__class__.__module__.startswith("transformers")  # loaded on demand, for chat and grammars


def test_config_that_disagrees_with_the_file_keeps_transformers(tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(EMBEDDED / f, tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False  # tokenizer.json's post-processor adds <s>; transformers would rewrite it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert RustTokenizerFiles.open(str(tmp_path)) is None
    from transformers import AutoTokenizer

    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("Once upon") == AutoTokenizer.from_pretrained(str(tmp_path)).encode("Once upon")
