"""Prompt sets as other stacks make them: jsonl, parquet and HF ``datasets`` folders (``save_to_disk``).

A row is read with verl's column names as they are (``data_source``, ``prompt`` as chat messages or a
string, ``reward_model.ground_truth``, ``extra_info``; ``ability`` and other columns pass into
``extra_info`` untouched) or this project's older names (``messages``, ``ground_truth`` / ``answer``).
``data.columns`` maps other names: ``{prompt: question, ground_truth: reward_model.answer}`` (a dotted
name reaches into a struct column). Chat messages go through the tokenizer's chat template exactly as
transformers applies it (``apply_chat_template(..., add_generation_prompt=True)``), so the ids are those a
GLM-5 tokenizer folder's template gives. A bad row is one line naming file, row and column.

Parquet is read with pyarrow — a folder of parquet shards (``train-00000-of-00004.parquet``, ...) as one
dataset with ``pyarrow.dataset``, its rows named by shard —, HF folders with ``datasets.load_from_disk``
(all imported only when such a file is given); every format yields the same Python values, so the same
rows give the same prompts. Chat messages must have one of the template's roles (``ROLES``), and every
string must be valid Unicode (a lone surrogate is refused naming the row and column).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

from glm5_mcore.data.jsonl import decode_json_line

FIELDS = ("prompt", "ground_truth", "data_source", "extra_info")
"""The fields ``data.columns`` can map (to a column name, dotted for a struct's member)."""
GROUND_TRUTH_COLUMNS = ("reward_model.ground_truth", "ground_truth", "answer")
ROLES = ("system", "user", "assistant", "observation", "tool")
"""Chat roles a prompt's messages may have: GLM-5's template's (tool results as ``observation``) and the
``tool`` role of HF templates."""
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files of a ``datasets`` ``save_to_disk`` folder (a Dataset's, a DatasetDict's)."""
MISSING = object()


class PromptDataError(ValueError):
    """A bad prompt set or row; the message names the file, the row and the column."""


def _fmt(path: Path) -> str:
    if path.is_dir():
        if any((path / f).is_file() for f in HF_MARKERS):
            return "hf"
        if _shards(path):
            return "parquet_dir"
        raise PromptDataError(f"{path}: neither a datasets save_to_disk folder (no {' / '.join(HF_MARKERS)}) nor a "
                              "folder of .parquet shards")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise PromptDataError(f"{path}: unknown prompt set format (expected .jsonl, .parquet, a folder of .parquet "
                          "shards or a datasets save_to_disk folder)")


def _shards(path: Path) -> list[Path]:
    """The ``.parquet`` files under ``path`` (sub-folders too), in path order; hidden and ``_`` files (Spark's
    ``_SUCCESS``, ``.crc``) left out, as pyarrow's dataset discovery does."""
    return sorted(f for f in path.rglob("*.parquet") if f.is_file() and not any(
        part.startswith((".", "_")) for part in f.relative_to(path).parts))


def _parquet_shards(path: Path) -> Iterator[tuple[str, Any]]:
    """The rows of a folder of parquet shards, read as one dataset (``pyarrow.dataset``: one schema, a
    column missing from a shard is null there); ``where`` names the shard and its row."""
    import pyarrow.dataset as pads

    try:
        ds = pads.dataset([str(f) for f in _shards(path)], format="parquet")
        fragments = sorted(ds.get_fragments(), key=lambda f: f.path)
    except Exception as e:
        raise PromptDataError(f"{path}: not a readable folder of parquet shards ({type(e).__name__}: {e})") from None
    for frag in fragments:
        try:
            rows = frag.to_table(schema=ds.schema).to_pylist()
        except Exception as e:  # a shard whose columns do not fit the others'
            raise PromptDataError(f"{frag.path}: cannot be read with the folder's other shards "
                                  f"({type(e).__name__}: {e})") from None
        for i, row in enumerate(rows):
            yield f"{frag.path} row {i}", row


def iter_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of ``path``; ``where`` names the file and row (``file:line`` for jsonl,
    ``file row i`` otherwise, 0-based like pandas / datasets)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: prompt file not found")
    fmt = _fmt(path)
    if fmt == "parquet_dir":
        yield from _parquet_shards(path)
        return
    if fmt == "jsonl":
        with path.open("rb") as f:
            for n, raw in enumerate(f, 1):
                if raw.strip():
                    yield f"{path}:{n}", decode_json_line(raw, f"{path}:{n}", PromptDataError)
        return
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow's errors: one line naming the file
            raise PromptDataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        rows = table.to_pylist()
    else:
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:
            raise PromptDataError(f"{path}: not a datasets save_to_disk folder ({type(e).__name__}: {e})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise PromptDataError(f"{path}: a DatasetDict with splits {sorted(ds)}; point data.train / data.val "
                                  f"at one split's folder, e.g. {path / sorted(ds)[0]}")
        rows = ds.to_list()
    for i, row in enumerate(rows):
        yield f"{path} row {i}", row


def _get(row: dict, name: str) -> Any:
    """``row[name]``, a dotted name reaching into struct columns; ``MISSING`` when absent."""
    v: Any = row
    for part in name.split("."):
        if not isinstance(v, dict) or part not in v:
            return MISSING
        v = v[part]
    return v


def row_fields(row: Any, where: str, columns: dict) -> dict:
    """The row's prompt (str or messages), ground truth, data source and extra info, by ``columns``
    (field → column) or the default names; errors name ``where`` and the column."""
    if not isinstance(row, dict):
        raise PromptDataError(f"{where}: expected an object (a row of named columns)")
    bad = set(columns) - set(FIELDS)
    if bad:
        raise PromptDataError(f"data.columns: unknown field(s) {sorted(bad)}; one of {FIELDS}")

    def pick(field: str, defaults: tuple[str, ...]) -> tuple[Optional[str], Any]:
        names = (columns[field],) if field in columns else defaults
        for name in names:
            v = _get(row, name)
            if v is not MISSING:
                return name, v
        if field in columns:
            raise PromptDataError(f"{where}: no column {columns[field]!r} (data.columns.{field})")
        return None, None

    pcol, prompt = pick("prompt", ("prompt", "messages"))
    if pcol is None:
        raise PromptDataError(f"{where}: needs a column 'prompt' (a string or chat messages) or 'messages'")
    if isinstance(prompt, (list, tuple)):
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise PromptDataError(f"{where}: column {pcol!r} message {j} must be {{role: str, content: str}}")
            if m["role"] not in ROLES:
                raise PromptDataError(f"{where}: column {pcol!r} message {j} has the role {m['role']!r}; the chat "
                                      f"template's roles are {', '.join(ROLES)}")
        prompt = [dict(m) for m in prompt]
    elif not isinstance(prompt, str):
        raise PromptDataError(f"{where}: column {pcol!r} must be a string or a list of chat messages, "
                              f"not {type(prompt).__name__}")
    gcol, gt = pick("ground_truth", GROUND_TRUTH_COLUMNS)
    dcol, source = pick("data_source", ("data_source",))
    if dcol is not None and not isinstance(source, str):
        raise PromptDataError(f"{where}: column {dcol!r} must be a string")
    ecol, extra = pick("extra_info", ("extra_info",))
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise PromptDataError(f"{where}: column {ecol!r} must be an object (a struct)")
    if "ability" in row and "ability" not in extra:
        extra = {**extra, "ability": row["ability"]}
    if gcol is None:  # verl's reward manager: a KeyError at the first step
        raise PromptDataError(f"{where}: no 'ground_truth' (or 'answer') field for the reward function (verl's "
                              "'reward_model.ground_truth' also counts); give one on every row (null where none is needed)")
    for col, v in ((pcol, prompt), (gcol, gt), (dcol, source), (ecol, extra)):
        _check_text(v, where, col)
    return {"prompt": prompt, "ground_truth": gt, "data_source": source, "extra_info": extra}


def _check_text(v: Any, where: str, col: Optional[str]) -> None:
    """Every string in ``v`` is valid Unicode (a JSON ``\\ud800`` escape gives a lone surrogate, which no
    tokenizer or UTF-8 writer takes): else one line naming the row and column."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PromptDataError(f"{where}: column {col!r}: a lone surrogate {v[e.start]!r} at character {e.start} "
                                  f"(not valid Unicode text: {v[max(0, e.start - 20): e.start]!r} comes before it)") from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_text(x, where, f"{col}.{k}")
    elif isinstance(v, (list, tuple)):
        for j, x in enumerate(v):
            _check_text(x, where, f"{col}[{j}]")


def render_prompt(tokenizer, prompt: str | list, chat_template: bool, where: str) -> str:
    """The prompt text: chat messages through the tokenizer's template (with the generation prompt), a
    string as is (or as one user message with ``data.chat_template``)."""
    if isinstance(prompt, str):
        if not chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if not getattr(tokenizer, "chat_template", None):
        raise PromptDataError(f"{where}: chat messages need a tokenizer with a chat template "
                              "(model.hf_dir's tokenizer_config.json / chat_template.jinja has none)")
    try:
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template's own raise_exception / a jinja error: name the row
        raise PromptDataError(f"{where}: the chat template failed on this row ({type(e).__name__}: {e})") from None
