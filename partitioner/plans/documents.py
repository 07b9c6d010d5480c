"""Reading plan and spec files safely: bounded in size, depth and expansion; never running code.

A plan or spec file is small (a GPT-2-xl plan, fingerprint included, is about 100 KB), so
anything far larger is a mistake: the wrong file, or a generated one gone wrong. Parsing it
anyway costs minutes and gigabytes (a 54 MB YAML file took 458 s and 1.6 GB), so the size is
checked before parsing. Nesting is bounded too: ``json.loads`` and PyYAML recurse, and a
deeply nested document raises ``RecursionError`` (or later breaks the code that walks it).
YAML anchors let a 1 KB file stand for billions of values (each alias is a reference, cheap
to load, but expanded when the plan is written back as JSON), and may refer to themselves;
both are refused by counting the values as JSON would write them.

Every problem raises the error class the caller names (``PlanFormatError`` for plan files,
``SpecError`` for specs), with the path, what is wrong and what to do.

Example:
    >>> from partitioner.errors import SpecError
    >>> check_document([[[1]]], "spec.yaml", SpecError)
    >>> try:
    ...     check_document({"a": [[[[1]]]]}, "spec.yaml", SpecError, max_depth=3)
    ... except SpecError as error:
    ...     print(error)
    spec.yaml nests deeper than 3 levels; a plan or spec is a few levels deep: check that \
this is the file you meant
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from partitioner.errors import PartitionError

__all__ = ["unknown_keys", "MAX_DOCUMENT_BYTES", "MAX_DEPTH", "MAX_VALUES", "read_text",
           "parse_json", "parse_yaml", "check_document"]

#: Plan and spec files larger than this are refused before parsing.
MAX_DOCUMENT_BYTES = 16 * 2**20
#: Containers nested deeper than this are refused (plans and specs nest about 6 deep).
MAX_DEPTH = 64
#: Documents that expand to more values than this are refused (YAML aliases expand).
MAX_VALUES = 2**22


def read_text(path: str | Path, error: type[PartitionError], what: str = "plan file") -> str:
    """The text of a plan or spec file, refusing what cannot be one before parsing it.

    Args:
        path: the file.
        error: the class to raise.
        what: what the file should be, for messages (``"plan file"``, ``"spec"``).

    Raises:
        error: the path is missing or a directory, cannot be read, is larger than
            :data:`MAX_DOCUMENT_BYTES`, or is not UTF-8 text.
    """
    path = Path(path)
    if path.is_dir():
        raise error(f"cannot read {what} {str(path)!r}: it is a directory; pass the path "
                    f"of a {what} inside it")
    try:
        with path.open("rb") as file:
            # Read at most one byte past the limit: /dev/zero and growing files stop too.
            data = file.read(MAX_DOCUMENT_BYTES + 1)
    except FileNotFoundError as caught:
        raise error(f"cannot read {what} {str(path)!r}: it does not exist (looked in "
                    f"{path.resolve().parent}); check the path") from caught
    except OSError as caught:
        raise error(f"cannot read {what} {str(path)!r}: {caught.strerror or caught}; check "
                    "the path and its permissions") from caught
    if len(data) > MAX_DOCUMENT_BYTES:
        size = _size(path, len(data))
        raise error(f"{what} {str(path)!r} is {size}, over the {MAX_DOCUMENT_BYTES >> 20} MiB "
                    f"limit for plan and spec files (MAX_DOCUMENT_BYTES; plans of the largest "
                    "models are under 1 MiB): check that this is the file you meant")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as caught:
        raise error(f"{what} {str(path)!r} is not UTF-8 text (byte {data[caught.start]:#04x} at "
                    f"offset {caught.start}); a {what} is JSON or YAML text: check that this "
                    "is the file you meant") from caught


def parse_json(text: str, path: str | Path, error: type[PartitionError],
               what: str = "plan file") -> Any:
    """Parse JSON text read from ``path`` (``NaN`` and ``Infinity`` are not JSON: refused).

    Raises:
        error: the text is not JSON, writes a key twice in one object (``json.loads`` keeps
            the last silently), nests too deeply, or expands too far.
    """
    try:
        data = json.loads(text, parse_constant=_refuse_constant,
                          object_pairs_hook=_unique_pairs)
    except _DuplicateKey as caught:
        raise error(f"{what} {str(path)!r} {caught}") from caught
    except json.JSONDecodeError as caught:
        raise error(f"{what} {str(path)!r} is not valid JSON: {caught}") from caught
    except ValueError as caught:
        raise error(f"{what} {str(path)!r} is not valid JSON: {caught}; write numbers "
                    "(or null)") from caught
    except RecursionError as caught:
        raise error(_too_deep(f"{what} {str(path)!r}", MAX_DEPTH)) from caught
    check_document(data, f"{what} {str(path)!r}", error)
    return data


def parse_yaml(text: str, path: str | Path, error: type[PartitionError],
               what: str = "spec") -> Any:
    """Parse YAML text read from ``path`` as ``yaml.safe_load`` (no Python objects built).

    Raises:
        error: PyYAML is missing, or the text is not YAML, writes a key twice in one mapping
            (plain YAML keeps the last silently), nests too deeply, or expands too far
            (aliases).
    """
    try:
        import yaml
    except ImportError as caught:
        raise error(f"{what} {str(path)!r} is YAML, which needs PyYAML: pip install "
                    "'partitioner[yaml]' (or write it as JSON)") from caught
    try:
        # A SafeLoader subclass: it builds no Python objects, as yaml.safe_load.
        data = yaml.load(text, Loader=_unique_keys_loader(yaml))
    except _DuplicateKey as caught:
        raise error(f"{what} {str(path)!r} {caught}") from caught
    except yaml.YAMLError as caught:
        raise error(f"{what} {str(path)!r} is not valid YAML: {caught}") from caught
    except RecursionError as caught:
        raise error(_too_deep(f"{what} {str(path)!r}", MAX_DEPTH)) from caught
    check_document(data, f"{what} {str(path)!r}", error)
    return data


class _DuplicateKey(ValueError):
    """A mapping names one key twice (JSON and YAML parsers would keep the last silently)."""


_DUPLICATE_FIX = "; a key may appear once per mapping: remove one (or merge them)"


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: a dict, refusing a key written twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"writes key {key!r} twice in one mapping{_DUPLICATE_FIX}")
        out[key] = value
    return out


def _unique_keys_loader(yaml: Any) -> type:
    """A ``yaml.SafeLoader`` that refuses a key written twice in one mapping (merge keys,
    ``<<: *anchor``, may still be overridden)."""

    class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc, name-defined]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool)):
                    continue  # an unhashable key: safe_load itself refuses it
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise _DuplicateKey(f"writes key {key!r} twice in one mapping (lines "
                                        f"{seen[key]} and {line}){_DUPLICATE_FIX}")
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def check_document(data: Any, where: str | Path, error: type[PartitionError], *,
                   max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> None:
    """Refuse parsed data that nests deeper than ``max_depth``, refers to itself, or expands
    (as JSON, aliases written out) to more than ``max_values`` values.

    Walks iteratively and visits each container once, so neither depth nor aliases make
    the check itself slow or recursive.

    Raises:
        error: naming ``where`` and what to do.
    """
    sizes: dict[int, int] = {}  # values below a container, itself included (memoized)
    heights: dict[int, int] = {}  # levels of containers from it down (memoized)
    open_ids: set[int] = set()
    stack: list[tuple[Any, int, bool]] = [(data, 1, False)]
    while stack:
        node, depth, finished = stack.pop()
        key = id(node)
        if finished:
            children = _children(node)
            sizes[key] = 1 + sum(sizes.get(id(child), 1) for child in children)
            heights[key] = 1 + max((heights.get(id(child), 0) for child in children), default=0)
            open_ids.discard(key)
            if sizes[key] > max_values:
                raise error(f"{where} expands to more than {max_values:,} values (YAML "
                            "aliases written out); write the values out, or check that this "
                            "is the file you meant")
            continue
        if key in open_ids:
            raise error(f"{where} refers to itself (a YAML alias inside its own anchor); "
                        "a plan or spec is a tree: write the repeated part out")
        if depth + heights.get(key, 1) - 1 > max_depth:
            raise error(_too_deep(where, max_depth))
        if key in sizes:
            continue  # an alias of a container already walked: counted, not walked again
        open_ids.add(key)
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in _children(node)
                     if isinstance(child, (dict, list, tuple)))


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    if isinstance(node, (list, tuple)):
        return list(node)
    return []


def _too_deep(where: str | Path, limit: int) -> str:
    return (f"{where} nests deeper than {limit} levels; a plan or spec is a few levels deep: "
            "check that this is the file you meant")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _size(path: Path, read: int) -> str:
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    size = max(size, read)
    return f"{size / 2**20:.1f} MiB" if size > read else f"over {size / 2**20:.1f} MiB"


def unknown_keys(data: dict[str, Any], known: tuple[str, ...], where: str) -> list[str]:
    """A problem per key of ``data`` not in ``known``, suggesting the closest known key."""
    problems = []
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys are {', '.join(known)}"
            problems.append(f"{where}{key}: unknown key; {hint}")
    return problems
