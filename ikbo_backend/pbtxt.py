"""Triton model configs as protobuf text: read, render in a compact layout with comments, write.

Configs are ModelConfig messages (`tritonclient.grpc.model_config_pb2`), never edited as strings.
`render` prints any message in the layout of hand-written config.pbtxt files, which
`text_format.MessageToString` does not (it prints one scalar a line): fields in declaration order,
repeated scalars as lists (`dims: [ -1, 64 ]`), a message on one line where it fits in `WIDTH`,
repeated messages as lists (`input [ { ... }, { ... } ]`) with their columns aligned, map entries
one a line, top-level messages (`dynamic_batching`, `ensemble_scheduling`) as blocks. Comments go
above the top-level fields they explain. `text_format.Parse` reads the result back to the same message.
"""

from __future__ import annotations

import os
import tempfile
import textwrap
from pathlib import Path

from google.protobuf import descriptor, text_encoding, text_format
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2

ModelConfig = model_config_pb2.ModelConfig
WIDTH = 120
INDENT = "  "
ALWAYS = ("max_batch_size",)  # top-level fields printed even at their default (0: Triton does not batch)

_FD = descriptor.FieldDescriptor


def read_config(path) -> ModelConfig:
    return text_format.Parse(Path(path).read_text(), ModelConfig())


def write_text(path, text: str) -> None:
    """Write `text` to `path` atomically: a server reading the file never sees half of it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def comment(text: str) -> list[str]:
    """`text` as `# ` lines wrapped at WIDTH (paragraphs split at newlines)."""
    lines = []
    for paragraph in text.strip().split("\n"):
        lines += textwrap.wrap(paragraph, WIDTH - 2, break_on_hyphens=False) or [""]
    return [f"# {line}".rstrip() for line in lines]


def render(message, header: str = "", notes: dict[str, str] | None = None) -> str:
    """The text of `message`: `header` as comment lines first, then each top-level field, with
    `notes[field name]` (or `notes["<map field>.<key>"]` for one map entry) as comment lines above it."""
    notes = notes or {}
    lines = comment(header) if header else []
    for field, value in _fields(message, ALWAYS):
        if _is_map(field):
            for key in sorted(value):
                if f"{field.name}.{key}" in notes:
                    lines += comment(notes[f"{field.name}.{key}"])
                lines += _map_lines(field, {key: value[key]}, "")
            continue
        if field.name in notes:
            lines += comment(notes[field.name])
        if field.type == _FD.TYPE_MESSAGE and field.label != _FD.LABEL_REPEATED:
            lines += [f"{field.name} {{", *_block(value, INDENT), "}"]
        else:
            lines += _field_lines(field, value, "")
    return "\n".join(lines) + "\n"


def _fields(message, always=()):
    """(field, value) of the fields set in `message` (and those named in `always`), in declaration order."""
    present = dict(message.ListFields())
    for name in always:
        if name in message.DESCRIPTOR.fields_by_name:
            present.setdefault(message.DESCRIPTOR.fields_by_name[name], getattr(message, name))
    return sorted(present.items(), key=lambda item: item[0].index)


def _is_map(field) -> bool:
    return field.type == _FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _scalar(field, value) -> str:
    if field.type == _FD.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    if field.type == _FD.TYPE_BOOL:
        return "true" if value else "false"
    if field.type in (_FD.TYPE_STRING, _FD.TYPE_BYTES):
        return f'"{text_encoding.CEscape(value, as_utf8=True)}"'
    return str(value)


def _tokens(message) -> list[str]:
    """`message`'s fields as one-line tokens (`name: value`, `dims: [ ... ]`, `value: { ... }`)."""
    tokens = []
    for field, value in _fields(message):
        if _is_map(field):
            tokens += [f"{field.name} {_inline_entry(field, key, value[key])}" for key in sorted(value)]
        elif field.label == _FD.LABEL_REPEATED and field.type == _FD.TYPE_MESSAGE:
            tokens.append(f"{field.name} [ {', '.join(_inline(item) for item in value)} ]")
        elif field.type == _FD.TYPE_MESSAGE:
            tokens.append(f"{field.name}: {_inline(value)}")
        else:
            tokens.append(_scalar_token(field, value))
    return tokens


def _scalar_token(field, value) -> str:
    if field.label == _FD.LABEL_REPEATED:
        return f"{field.name}: [ {', '.join(_scalar(field, v) for v in value)} ]"
    return f"{field.name}: {_scalar(field, value)}"


def _braces(tokens: list[str]) -> str:
    return f"{{ {' '.join(tokens)} }}" if tokens else "{ }"


def _inline(message) -> str:
    return _braces(_tokens(message))


def _entry_tokens(field, key, value) -> list[str]:
    key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
    shown = _inline(value) if value_field.type == _FD.TYPE_MESSAGE else _scalar(value_field, value)
    return [f"key: {_scalar(key_field, key)}", f"value: {shown}"]


def _inline_entry(field, key, value) -> str:
    return _braces(_entry_tokens(field, key, value))


def _aligned(rows: list[list[str]]) -> list[list[str]]:
    """Pad every column but the last shared one to its widest token, so that one-line entries read as a table."""
    shared = min(len(row) for row in rows) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(max(shared, 0))]
    return [[token.ljust(widths[i]) if i < shared else token for i, token in enumerate(row)] for row in rows]


def _map_lines(field, entries: dict, indent: str) -> list[str]:
    """One line per entry (sorted by key), the values aligned; a message value too long for it as a block."""
    rows = _aligned([_entry_tokens(field, key, entries[key]) for key in sorted(entries)])
    lines = []
    for row, key in zip(rows, sorted(entries)):
        line = f"{indent}{field.name} {_braces(row)}"
        if len(line) <= WIDTH or not isinstance(entries[key], Message):
            lines.append(line)
        else:
            lines += [f"{indent}{field.name} {{", f"{indent}{INDENT}{row[0]}"]
            lines += [f"{indent}{INDENT}value {{", *_block(entries[key], indent + 2 * INDENT), f"{indent}{INDENT}}}"]
            lines.append(f"{indent}}}")
    return lines


def _field_lines(field, value, indent: str) -> list[str]:
    if _is_map(field):
        return _map_lines(field, value, indent)
    if field.label == _FD.LABEL_REPEATED and field.type == _FD.TYPE_MESSAGE:
        items = [_braces(row) for row in _aligned([_tokens(item) for item in value])]
        one_line = f"{indent}{field.name} [ {', '.join(items)} ]"
        if len(one_line) <= WIDTH:
            return [one_line]
        inner = indent + INDENT
        if all(len(inner + item) < WIDTH for item in items):
            return [
                f"{indent}{field.name} [",
                *[f"{inner}{item}," for item in items[:-1]],
                inner + items[-1],
                f"{indent}]",
            ]
        lines = [f"{indent}{field.name} ["]
        for i, item in enumerate(value):
            lines += [f"{inner}{{", *_block(item, inner + INDENT), f"{inner}}}" + ("," if i < len(value) - 1 else "")]
        return lines + [f"{indent}]"]
    if field.type == _FD.TYPE_MESSAGE:
        line = f"{indent}{field.name}: {_inline(value)}"
        if len(line) <= WIDTH:
            return [line]
        return [f"{indent}{field.name} {{", *_block(value, indent + INDENT), f"{indent}}}"]
    return [indent + _scalar_token(field, value)]


def _block(message, indent: str) -> list[str]:
    """`message`'s fields one a line (each as compact as fits) at `indent`."""
    lines = []
    for field, value in _fields(message):
        lines += _field_lines(field, value, indent)
    return lines
