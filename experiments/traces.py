"""Request traces read into one list of TraceEntry (arrival offset, prompt and output tokens), whatever
the file's format:

- jsonl: splitserve's own rows, {"prompt_len", "output_len"[, "prefix_id"][, "arrival_s"]}.
- azure: the Azure LLM inference traces (github.com/Azure/AzurePublicDataset: 2023's
  AzureLLMInferenceTrace_code.csv / _conv.csv, 2024's *_1week.csv), header TIMESTAMP,ContextTokens,
  GeneratedTokens; TIMESTAMP is a date and time, `2023-11-16 18:15:46.6805900` (2023: 7 fractional
  digits) or `2024-05-12 00:00:00.001163+00:00` (2024: an offset, and no fraction on whole seconds).
- burstgpt: BurstGPT (github.com/HPMLL/BurstGPT, BurstGPT_1.csv ...), header Timestamp,Model,Request
  tokens,Response tokens,Total tokens,Log Type; Timestamp in seconds from 0:00 of the trace's first day,
  Model ChatGPT or GPT-4, Log Type "Conversation log" or "API log". Other columns are ignored.

The format is named, or found from the file's first line ("auto"). Rows with 0 output tokens are
requests that failed (BurstGPT_N.csv has them; its *_without_fails_N.csv does not) and are skipped
unless keep_failed, which sends them asking for 1 token so the arrival process stays whole. Then rows
are sorted by time, cut to the window (start_s and duration_s in the trace's own seconds, then
max_rows), and their times rebased so the first kept row arrives at 0. Speeding the replay up or down
is the workload's: scale_gaps (time_scale) or scale_to_rate (a target mean rate).
"""

from __future__ import annotations

import csv
import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, TextIO

FORMATS = ("auto", "jsonl", "azure", "burstgpt")
# Small invented traces in each format, for tests and examples. Not "traces/": a folder beside traces.py of
# the same name is a namespace package to mypy, which then finds none of this module.
SAMPLES_DIR = Path(__file__).with_name("trace_samples")

# The columns each CSV format needs (lowercased: headers are matched without case or surrounding spaces).
_COLUMNS = {
    "azure": ("timestamp", "contexttokens", "generatedtokens"),
    "burstgpt": ("timestamp", "model", "request tokens", "response tokens", "log type"),
}
_AZURE_TIME = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:?\d\d)?")


class TraceEntry(NamedTuple):
    arrival_s: float | None  # seconds after the first kept row; None: JSONL rows without arrival_s
    prompt_len: int
    output_len: int
    prefix_id: int | None = None  # JSONL only: rows with one id share a prompt prefix


class _Row(NamedTuple):
    """One parsed row, before filtering: time_s on the format's own clock (epoch or trace seconds)."""

    time_s: float | None
    prompt_len: int
    output_len: int
    prefix_id: int | None = None
    model: str | None = None
    log_type: str | None = None


@dataclass(frozen=True, slots=True)
class TraceConfig:
    path: str
    format: str = "auto"  # one of FORMATS; auto: a JSON row, or an Azure or BurstGPT CSV header
    model: str | None = None  # burstgpt: keep only rows of this Model, e.g. "GPT-4"
    log_type: str | None = None  # burstgpt: keep only rows of this Log Type, e.g. "Conversation log"
    keep_failed: bool = False  # keep rows with 0 output tokens (sent asking for 1 token)
    start_s: float = 0.0  # skip rows earlier than this many seconds after the trace's first row
    duration_s: float | None = None  # then keep the rows of this many seconds
    max_rows: int | None = None  # then keep at most this many rows

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"trace format must be one of {FORMATS}, got {self.format!r}")
        if self.start_s < 0 or (self.duration_s is not None and self.duration_s <= 0):
            raise ValueError(
                f"trace window needs start_s >= 0 and duration_s > 0, got {self.start_s}, {self.duration_s}"
            )
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"trace max_rows must be at least 1, got {self.max_rows}")


def load_trace(cfg: TraceConfig) -> tuple[TraceEntry, ...]:
    """The trace's entries, in arrival order. Cached while the file is unchanged: a workload reads its
    trace for the requests and again for their arrivals, once per swept rate, and BurstGPT_1.csv has 1.4M rows."""
    return _load(cfg, Path(cfg.path).stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(cfg: TraceConfig, mtime_ns: int) -> tuple[TraceEntry, ...]:
    fmt = detect_format(cfg.path) if cfg.format == "auto" else cfg.format
    if fmt != "burstgpt" and (cfg.model is not None or cfg.log_type is not None):
        raise ValueError(f"{cfg.path}: model and log_type filter BurstGPT traces; this one is {fmt}")
    rows = list(_read_rows(cfg.path, fmt))
    kept = _window([r for r in rows if _wanted(r, cfg)], cfg)
    if not kept:
        raise ValueError(f"{cfg.path}: none of its {len(rows)} rows is left to replay; {_filters_seen(cfg, rows)}")
    first = kept[0].time_s
    return tuple(
        TraceEntry(
            None if r.time_s is None or first is None else r.time_s - first,
            r.prompt_len,
            max(1, r.output_len),  # a kept failure asks for one token
            r.prefix_id,
        )
        for r in kept
    )


def detect_format(path: str | Path) -> str:
    """jsonl, azure or burstgpt, from the file's first non-blank line: a JSON object or a CSV header."""
    with open(path, newline="") as f:
        first = next((line for line in f if line.strip()), "")
    if first.lstrip().startswith("{"):
        return "jsonl"
    columns = {name.strip().lower() for name in next(csv.reader([first]), [])}
    for fmt, needed in _COLUMNS.items():
        if columns.issuperset(needed):
            return fmt
    raise ValueError(
        f"{path}: cannot tell the trace format from its first line {first.strip()[:100]!r}: expected a JSON row, "
        "an Azure header (TIMESTAMP,ContextTokens,GeneratedTokens) or a BurstGPT header (Timestamp,Model,"
        "Request tokens,Response tokens,Total tokens,Log Type); or name the format (trace_format)"
    )


def scale_gaps(offsets: Sequence[float], time_scale: float) -> list[float]:
    """Arrivals with every gap multiplied by time_scale (2.0: half the rate; 0.5: twice the rate).
    The offsets start at 0, so scaling each offset scales each gap."""
    return [t * time_scale for t in offsets]


def scale_to_rate(offsets: Sequence[float], rate: float) -> list[float]:
    """Arrivals with every gap multiplied by one factor, so that the mean rate, (n - 1) gaps over the
    first-to-last span, is `rate` requests/s: the trace's bursts and lulls, at a chosen load."""
    if len(offsets) < 2:
        return list(offsets)
    span = offsets[-1] - offsets[0]
    if span <= 0:
        raise ValueError(f"all {len(offsets)} trace rows arrive at once: there is no rate to rescale")
    return scale_gaps(offsets, (len(offsets) - 1) / (rate * span))


def arrival_times(entries: Sequence[TraceEntry], path: str) -> list[float]:
    """Each entry's arrival offset; a ValueError if the trace has none (JSONL rows without arrival_s)."""
    times = [e.arrival_s for e in entries if e.arrival_s is not None]
    if len(times) != len(entries):
        raise ValueError(f"{path}: replaying arrivals needs timestamps; give every JSONL row an arrival_s")
    return times


def _read_rows(path: str, fmt: str) -> Iterator[_Row]:
    """Each row of the file, parsed; a ValueError naming the file and line for one that is not."""
    lines, parse, expected = _READERS[fmt]
    with open(path, newline="") as f:
        for number, raw in lines(path, f):
            try:
                row = parse(raw)
            except (ValueError, TypeError, KeyError) as e:  # a short CSV row's missing values are None
                raise ValueError(f"{path}:{number}: {expected} ({type(e).__name__}: {e})") from None
            yield row


def _json_lines(path: str, f: TextIO) -> Iterator[tuple[int, str]]:
    return ((n, line) for n, line in enumerate(f, 1) if line.strip())


def _csv_lines(fmt: str) -> Callable[[str, TextIO], Iterator[tuple[int, dict[str, str]]]]:
    def lines(path: str, f: TextIO) -> Iterator[tuple[int, dict[str, str]]]:
        reader = csv.DictReader(f)
        reader.fieldnames = [name.strip().lower() for name in reader.fieldnames or ()]
        missing = [name for name in _COLUMNS[fmt] if name not in reader.fieldnames]
        if missing:
            raise ValueError(f"{path}:{reader.line_num}: a {fmt} trace needs the columns {missing}")
        return ((reader.line_num, row) for row in reader)

    return lines


def _jsonl_row(text: str) -> _Row:
    row = json.loads(text)
    if not isinstance(row, dict):
        raise ValueError(f"{text.strip()[:40]!r} is not a JSON object")
    arrival = row.get("arrival_s")
    time_s = None if arrival is None else _seconds(arrival)
    return _Row(time_s, _count(row["prompt_len"]), _count(row["output_len"]), row.get("prefix_id"))


def _azure_row(row: dict[str, str]) -> _Row:
    return _Row(_azure_seconds(row["timestamp"]), _count(row["contexttokens"]), _count(row["generatedtokens"]))


def _burstgpt_row(row: dict[str, str]) -> _Row:
    prompt_len, output_len = _count(row["request tokens"]), _count(row["response tokens"])
    return _Row(_seconds(row["timestamp"]), prompt_len, output_len, None, row["model"], row["log type"])


def _azure_seconds(text: str) -> float:
    """Seconds since the epoch. The fraction is read apart from the rest: the 2023 traces write 7
    digits, more than strptime's %f takes. No offset (2023) means UTC: only differences matter."""
    match = _AZURE_TIME.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"TIMESTAMP {text!r} is not a date and time like 2023-11-16 18:15:46.6805900")
    whole, fraction, offset = match.groups()
    moment = datetime.fromisoformat(whole + (offset or ""))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp() + float(fraction or 0)


def _seconds(value: str | float) -> float:
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a time in seconds")
    return seconds


def _count(value: str | int) -> int:
    count = int(value)
    if count < 0:
        raise ValueError(f"{value!r} is not a token count")
    return count


class _Reader(NamedTuple):
    lines: Callable[[str, TextIO], Iterator[tuple[int, Any]]]
    parse: Callable[[Any], _Row]
    expected: str  # what a row needs, for the error on one that does not parse


_READERS: dict[str, _Reader] = {
    "jsonl": _Reader(_json_lines, _jsonl_row, "rows need prompt_len and output_len (and a number arrival_s, if any)"),
    "azure": _Reader(_csv_lines("azure"), _azure_row, "rows need a TIMESTAMP and whole ContextTokens, GeneratedTokens"),
    "burstgpt": _Reader(
        _csv_lines("burstgpt"), _burstgpt_row, "rows need a number Timestamp and whole Request, Response tokens"
    ),
}


def _wanted(row: _Row, cfg: TraceConfig) -> bool:
    if row.output_len == 0 and not cfg.keep_failed:
        return False
    return cfg.model in (None, row.model) and cfg.log_type in (None, row.log_type)


def _window(rows: list[_Row], cfg: TraceConfig) -> list[_Row]:
    """The rows within [first + start_s, first + start_s + duration_s), in time order, then max_rows."""
    timed = sum(r.time_s is not None for r in rows)
    if 0 < timed < len(rows):
        raise ValueError(f"{cfg.path}: give every JSONL row an arrival_s, or none")
    if rows and not timed:
        if cfg.start_s or cfg.duration_s is not None:
            raise ValueError(f"{cfg.path}: a window in seconds (start_s, duration_s) needs rows with arrival_s")
        return rows[: cfg.max_rows]
    rows = sorted(rows, key=lambda r: r.time_s or 0.0)
    start = (rows[0].time_s or 0.0) + cfg.start_s if rows else 0.0
    end = start + cfg.duration_s if cfg.duration_s is not None else math.inf
    return [r for r in rows if start <= (r.time_s or 0.0) < end][: cfg.max_rows]


def _filters_seen(cfg: TraceConfig, rows: Sequence[_Row]) -> str:
    """The settings that left no rows, beside the values the file has, for the error."""
    models = sorted({r.model for r in rows if r.model is not None})
    log_types = sorted({r.log_type for r in rows if r.log_type is not None})
    has = f" (the file has models {models} and log types {log_types})" if models else ""
    return (
        f"model={cfg.model!r}, log_type={cfg.log_type!r}{has}, keep_failed={cfg.keep_failed}, "
        f"start_s={cfg.start_s}, duration_s={cfg.duration_s}"
    )
