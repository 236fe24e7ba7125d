"""``python -m nanoserve generate --prompts FILE.jsonl --out OUT.jsonl``: serve a file of
prompts on the paged cache, in batches, with a progress bar and a summary.

Each input line is a JSON object with one of ``"prompt"`` (a user message: the tokenizer's
chat template is applied when it has one, unless ``--no-chat-template``), ``"messages"`` (a
chat) or ``"input_ids"`` (token ids, used as they are), and optionally an ``"id"``. Each
output line, in input order: ``{"id", "completion", "tokens", "prompt_tokens",
"finish_reason"}``, where ``tokens`` are the generated ids up to and including the first EOS
and ``finish_reason`` is ``"stop"`` (an EOS) or ``"length"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

PROMPT_KEYS = ("prompt", "messages", "input_ids")


def read_prompts(path: str) -> list[dict]:
    """The records of a JSONL file of prompts; ValueError naming ``--prompts`` and the line
    for anything that is not one of the forms above (nothing is loaded before this)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompts: no such file: {path}")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompts: {path} is not UTF-8 text ({error.reason})") from None
    records, ids = [], set()
    # lines end at \n only: JSON strings may hold U+2028 and the like, which splitlines cuts at
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--prompts: line {number} is not JSON ({error.msg})") from None
        keys = [k for k in PROMPT_KEYS if isinstance(record, dict) and k in record]
        if len(keys) != 1:
            raise ValueError(
                f"--prompts: line {number} needs exactly one of {', '.join(PROMPT_KEYS)}"
            )
        value = record[keys[0]]
        ok = {
            "prompt": isinstance(value, str),
            "messages": isinstance(value, list) and bool(value),
            "input_ids": isinstance(value, list)
            and bool(value)
            and all(type(t) is int and t >= 0 for t in value),  # (a bool is not an id)
        }[keys[0]]
        if not ok:
            raise ValueError(f"--prompts: line {number}: {keys[0]} has the wrong type")
        record.setdefault("id", len(records))
        key = json.dumps(record["id"])
        if key in ids:
            raise ValueError(
                f"--prompts: line {number}: the id {key} is taken (a record without an id "
                "takes its position, from 0); give each record its own id"
            )
        ids.add(key)
        records.append(record)
    if not records:
        raise ValueError(f"--prompts: {path} holds no prompt")
    return records


def check_out(path: str, prompts: str) -> None:
    """ValueError naming ``--out`` when its folder does not exist, it is a folder, or it is
    the ``--prompts`` file (opening it for the answers would empty it)."""
    if not Path(path).resolve().parent.is_dir():
        raise ValueError(f"--out: no such folder for {path}")
    if Path(path).is_dir():
        raise ValueError(f"--out: {path} is a folder; name a file in it")
    if Path(path).resolve() == Path(prompts).resolve():
        raise ValueError(f"--out: {path} is the --prompts file; write the answers elsewhere")


def token_ids(tokenizer, record: dict, chat_template: bool) -> list[int]:
    """The prompt of ``record`` as token ids."""
    if "input_ids" in record:
        return list(record["input_ids"])
    if "messages" in record:
        messages = record["messages"]
    elif chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        return tokenizer(record["prompt"])["input_ids"]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


def prompt_ids(tokenizer, records: list[dict], chat_template: bool, vocab: int | None) -> list:
    """Every record's token ids, checked before anything is generated or written:
    ValueError naming ``--prompts`` and the record's id for a prompt the tokenizer refuses,
    one with no tokens, or an id outside the model's vocabulary."""
    prompts = []
    for record in records:
        where = f"--prompts: the prompt with id {json.dumps(record['id'])}"
        try:
            ids = token_ids(tokenizer, record, chat_template)
        except Exception as error:  # a malformed chat, a template's own error
            raise ValueError(f"{where}: {type(error).__name__}: {error}") from None
        if not ids:
            raise ValueError(f"{where} has no tokens")
        outside = next((t for t in ids if vocab is not None and not 0 <= t < vocab), None)
        if outside is not None:
            raise ValueError(f"{where} holds token id {outside}, outside [0, {vocab})")
        prompts.append(ids)
    return prompts


def _summary(records: int, new_tokens: int, seconds: float, largest: dict) -> str:
    """The run's line: tokens/s and the largest pool a batch had (``largest``: its
    ``cache_stats``). Not the blocks in use: a call's finished rows give theirs back before
    its stats are read."""
    rate = new_tokens / seconds if seconds > 0 else float("inf")
    return (
        f"{records} prompts, {new_tokens} new tokens in {seconds:.1f} s ({rate:.1f} tokens/s); "
        f"KV pool: {largest.get('num_blocks', 0)} blocks of {largest.get('block_size', 0)} "
        f"tokens, {largest.get('bytes_reserved', 0) / 2**20:.2f} MiB reserved"
    )


def serve(args, model, tokenizer, prompts: list[list[int]]) -> int:
    """Generate for every record of ``args.prompts`` (its token ids: ``prompts``) in batches
    of ``args.batch_size`` on the patched ``model``; writes ``args.out`` and prints the
    summary. The answers go to a new file beside ``args.out`` (a name no file had) that
    replaces it once every prompt is answered: a call that fails leaves ``args.out`` as it
    was, and no other file is written over."""
    import torch

    from nanoserve.adapters.generate_batch import eos_ids

    options = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
    if args.do_sample:
        options.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    eos = eos_ids(model.generation_config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    start = time.perf_counter()
    partial = _new_file_beside(args.out)
    try:
        new_tokens, largest = _answer(args, model, tokenizer, prompts, options, pad, eos, partial)
        os.replace(partial, args.out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
    print(_summary(len(args.records), new_tokens, time.perf_counter() - start, largest))
    return 0


def _new_file_beside(out: str) -> str:
    """The path of a new empty file in ``out``'s folder, named after it, that no file had
    (``out.partial`` could be the prompts or another file of the user's), with the
    permissions ``open`` would have given it (``mkstemp`` makes it private)."""
    folder, name = os.path.split(os.path.abspath(out))
    handle, path = tempfile.mkstemp(prefix=f"{name}.", suffix=".partial", dir=folder)
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    return path


def _answer(args, model, tokenizer, prompts, options, pad, eos, path) -> tuple[int, dict]:
    """Writes ``path``: an answer line per record, generated in batches. Returns the new
    tokens and the largest pool's figures."""
    import torch
    from tqdm.auto import tqdm

    import nanoserve
    from nanoserve.adapters.generate_batch import left_padded

    records = args.records
    largest: dict = {}
    new_tokens = 0
    with open(path, "w") as out, tqdm(total=len(records), unit="prompt") as bar:
        for first in range(0, len(records), args.batch_size):
            rows = prompts[first : first + args.batch_size]
            ids, mask = left_padded(rows, pad, model)
            with torch.no_grad():
                sequences = model.generate(
                    input_ids=ids, attention_mask=mask, pad_token_id=pad, **options
                )
            stats = nanoserve.cache_stats(model)
            if stats.get("bytes_reserved", 0) >= largest.get("bytes_reserved", -1):
                largest = stats
            for i, generated in enumerate(sequences[:, ids.shape[1] :].tolist()):
                stop = next((j + 1 for j, t in enumerate(generated) if t in eos), None)
                tokens = generated[:stop]
                new_tokens += len(tokens)
                line = {
                    "id": records[first + i]["id"],
                    "completion": tokenizer.decode(tokens, skip_special_tokens=True),
                    "tokens": tokens,
                    "prompt_tokens": len(rows[i]),
                    "finish_reason": "stop" if stop is not None else "length",
                }
                out.write(json.dumps(line) + "\n")
            bar.update(len(rows))
    return new_tokens, largest
