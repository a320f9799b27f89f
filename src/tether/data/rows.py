"""Reading rows of examples: JSONL, JSON, Parquet, CSV, a `save_to_disk` directory, or a hub
dataset name; each problem with a file is one TetherError line naming it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tether.errors import TetherError


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TetherError(f"{path} is not valid UTF-8 (bad byte at offset {exc.start}); "
                          "re-encode the file as UTF-8") from None


def _read_jsonl(path: Path) -> list[dict]:
    text = _read_text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise TetherError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TetherError(f"{path} line {lineno} is not valid JSON ({exc.msg}); "
                              "each line must be one JSON object") from None
    return rows


def _read_csv(path: Path) -> list[dict]:
    return [dict(row) for row in csv.DictReader(_read_text(path).splitlines())]


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise TetherError(f"{path} is not a readable Parquet file ({type(exc).__name__})") from None


# The file formats, by suffix (any case); `.json` is JSON lines too, or one JSON array of objects.
READERS = {".jsonl": _read_jsonl, ".json": _read_jsonl, ".parquet": _read_parquet,
           ".csv": _read_csv}


def _read_saved_dataset(path: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise TetherError(f"{path} is a directory but not a saved `datasets` dataset; "
                          "pass a .jsonl/.parquet/.csv file or a save_to_disk directory") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise TetherError(f"{path} has no split {split!r}; available: {', '.join(ds)}")
        ds = ds[split]
    return ds.to_list()


def _read_hub(name: str, split: str) -> list[dict]:
    import datasets
    from huggingface_hub import constants

    cached = Path(datasets.config.HF_DATASETS_CACHE).joinpath(name.replace("/", "___")).exists()
    if constants.HF_HUB_OFFLINE and not cached:
        raise TetherError(f"data {name!r} is not a local file and HF_HUB_OFFLINE is set, and the "
                          "datasets cache has no copy of it; pass a local .jsonl/.parquet/.csv file")
    from tether.run.hub import go_offline, hub_reachable

    if not constants.HF_HUB_OFFLINE and not hub_reachable():
        if not cached:  # else the hub client retries with back-off before failing (issue 13)
            raise TetherError(f"data {name!r} is not a local file, the datasets cache has no copy "
                              "of it, and the hub cannot be reached (no network?); pass a local "
                              ".jsonl/.parquet/.csv file")
        go_offline()

    try:
        return datasets.load_dataset(name, split=split).to_list()
    except Exception as exc:  # offline, unknown name, bad split: all become one line
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TetherError(f"cannot load dataset {name!r} (not a local file; hub load failed: {first})") from None


def load_rows(source: str, split: str = "train") -> list[dict]:
    """Rows from a JSONL/JSON/Parquet/CSV file, a `save_to_disk` directory, or a hub dataset name."""
    path = Path(source).expanduser()
    if path.is_dir():
        rows = _read_saved_dataset(path, split)
    elif path.is_file():
        suffix = path.suffix.lower()
        if suffix not in READERS:
            raise TetherError(f"{source}: unknown data format {suffix!r}; use one of {', '.join(READERS)}")
        rows = READERS[suffix](path)
    elif path.suffix.lower() in READERS or source.startswith((".", "/", "~")):
        raise TetherError(f"data file {source} not found; check the path")
    else:
        rows = _read_hub(source, split)
    if not rows:
        raise TetherError(f"{source} has no rows; give a file with at least one example")
    if not all(isinstance(row, dict) for row in rows):
        raise TetherError(f"{source}: every row must be an object with named fields")
    return rows


def require_columns(rows: list[dict], columns: list[str] | tuple[str, ...], source: str) -> None:
    """TetherError naming the first missing column and the first row that lacks it."""
    for col in columns:
        for i, row in enumerate(rows):
            if col not in row or row[col] is None:
                have = ", ".join(sorted(rows[0]))
                raise TetherError(f"{source}: row {i} has no column {col!r} (columns found: {have}); "
                                  f"add the column or rename it to {col!r}")


