"""The files an operator names, read as hostile input (issue 24): a leaf that imports only
gemmd.errors, so that gemmd.yaml, the web configuration file and a GPU catalogue file
(--gpu-spec) are all read by the same code.

``read_file`` reads at most MAX_FILE_BYTES of a regular file (a FIFO, a socket or /dev/zero
is refused, not read forever); ``read_yaml`` reads one YAML document within MAX_DEPTH,
MAX_VALUES and MAX_PARSE_S, duplicate keys, alias bombs and huge integers refused, every
problem a ConfigError with its key path and line. Beside them: checks of a file name
(``path_problem``, ``cannot_write_in``), a value as an error message quotes it (``shown``)
and a file's sha256.
"""

from __future__ import annotations

import errno
import math
import os
import re
import reprlib
import ssl
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gemmd.errors import ConfigError

# ---------------------------------------------------------------- limits

# A configuration is a few kilobytes; these bounds only stop hostile or broken input (a
# device file, an alias bomb, a runaway generator) before it costs time or memory.
MAX_FILE_BYTES = 1 << 20  # read at most this much of a file
MAX_DEPTH = 32  # nesting of lists and mappings (gemmd's own schema needs 6)
MAX_VALUES = 100_000  # values in the document once YAML aliases are expanded
MAX_INT_CHARS = 100  # characters of an integer literal (Python's int() refuses > 4,300)
MAX_PARSE_S = 5.0  # wall time for reading the YAML
# The clock MAX_PARSE_S is measured on; tests put their own here rather than race it.
clock: Callable[[], float] = time.monotonic


def _problem(path: str, msg: str, line: int | None = None) -> str:
    where = f" (line {line})" if line else ""
    return f"{path or '<top>'}: {msg}{where}"


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = 6
_REPR.maxdict = 4


def _short(v: Any) -> str:
    """repr() bounded in length and work: values in messages may be huge or deep."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<an integer of ~{int(v.bit_length() * math.log10(2)) + 1} digits>"
    try:
        return _REPR.repr(v)
    except (ValueError, RecursionError):  # a huge integer inside a container
        return f"<a {_typename(v)}>"


def _key_text(key: Any) -> str:
    s = key if isinstance(key, str) else _short(key)
    return s if len(s) <= 80 else s[:77] + "..."


def _typename(v: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def file_identity(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, symlinks followed: what tells two names
    of one file from two files (the store's database replaced under it, an input given
    twice or written over); None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (model files and their pins). Raises OSError."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


NAME_MAX, PATH_MAX = 255, 4096  # bytes in one file name and in a whole path (Linux)


def shown(text: str, limit: int = 80) -> str:
    """A value as an error message quotes it: at most ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit - 25]}... ({len(text):,} characters)"


def cannot_write_in(directory: Path) -> str | None:
    """Why no file can be made in ``directory`` (strerror), or None. Makes and removes a
    file: the one reliable test (root passes os.access on /proc and /sys)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".gemmd-", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return str(e.strerror or e)
    return None


def path_problem(text: str) -> str | None:
    """Why ``text`` cannot name a file (a NUL, a name or path longer than Linux allows),
    or None. Checked before any stat(): those raise on such names instead of answering."""
    if "\0" in text:
        return "contains a NUL character"
    raw = os.fsencode(text)
    if len(raw) >= PATH_MAX:
        return f"a path of {len(raw):,} bytes is longer than the {PATH_MAX - 1:,} allowed"
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        return (f"a file name of {len(longest):,} bytes is longer than the {NAME_MAX} "
                "allowed")
    return None


# ---------------------------------------------------------------- reading YAML


class _DocError(Exception):
    """A problem found while reading the YAML, at a key path and a position."""

    def __init__(self, path: str, msg: str, mark: Any = None, node: Any = None):
        super().__init__(msg)
        self.path, self.msg, self.mark, self.node = path, msg, mark, node


# libyaml's parser (C) when PyYAML was built with it: 10-50x faster than the pure-Python
# one. Its own composer is recursive C code that overflows the stack on deep nesting, so
# gemmd composes the node graph itself from the parser's events (_compose).
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Constructor:
    """SafeConstructor's behaviour, minus its tracebacks (a mixin for either parser)."""

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)  # type: ignore[misc]
        except (yaml.YAMLError, _DocError):
            raise
        except Exception as e:  # noqa: BLE001 - each is the input's fault, not gemmd's
            # PyYAML's constructors let ValueError (a date that does not exist: 2024-13-01),
            # IndexError (!!int "") or AttributeError (!!timestamp x) through.
            tag = node.tag.rsplit(":", 1)[-1]
            what = _short(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            raise _DocError("", f"cannot read {what} as a {tag}: {e}", node.start_mark,
                            node) from e

    def construct_yaml_int(self: Any, node: Any) -> Any:  # self: a loader with this mixin
        text = str(node.value)
        if len(text) > MAX_INT_CHARS:
            raise _DocError("", f"integer of {len(text):,} characters: out of any range",
                            node.start_mark, node)
        return super().construct_yaml_int(node)  # type: ignore[misc]


class _PyLoader(_Constructor, yaml.SafeLoader):
    pass


_PyLoader.add_constructor("tag:yaml.org,2002:int", _PyLoader.construct_yaml_int)
if hasattr(yaml, "CSafeLoader"):
    class _CLoader(_Constructor, yaml.CSafeLoader):  # type: ignore[name-defined]
        pass

    _CLoader.add_constructor("tag:yaml.org,2002:int", _CLoader.construct_yaml_int)
    _Loader: type = _CLoader
else:  # pragma: no cover - PyYAML without libyaml
    _Loader = _PyLoader


class _Frame:
    __slots__ = ("node", "start", "keys", "key", "merge", "anchored")

    def __init__(self, node: Any, start: int, is_map: bool, anchored: bool):
        self.node, self.start, self.anchored = node, start, anchored
        self.keys: dict | None = {} if is_map else None
        self.key: Any = None
        self.merge = 0


def _path_of(stack: list[_Frame]) -> str:
    path = ""
    for f in stack:
        if f.keys is None:
            path += f"[{len(f.node.value)}]"
        elif f.key is not None:
            key = f.key.value if isinstance(f.key, yaml.ScalarNode) else "?"
            path = _join(path, _key_text(key))
    return path


def _compose(loader: Any, deadline: float) -> Any:
    """The document's root node (None for an empty stream), built without recursion.

    Refuses nesting deeper than MAX_DEPTH, more than MAX_VALUES values once aliases are
    expanded (an alias bomb), recursive aliases, duplicate keys, merge-key chains deeper
    than MAX_DEPTH and documents that take longer than MAX_PARSE_S to read.
    """
    get, resolve = loader.get_event, loader.resolve
    get()  # StreamStartEvent
    ev = get()
    if isinstance(ev, yaml.StreamEndEvent):
        return None
    anchors: dict[str, Any] = {}
    sizes: dict[int, int] = {}  # id(anchored node) -> values it expands to, once complete
    merges: dict[int, int] = {}  # id(mapping) -> depth of its merge-key (<<) chain
    stack: list[_Frame] = []
    root, count, events = None, 0, 0
    node: yaml.Node | None  # None: only until an alias is checked
    while True:
        ev = get()
        events += 1
        if not events & 1023 and clock() > deadline:
            raise _DocError(_path_of(stack), f"reading took longer than {MAX_PARSE_S:g} s",
                            ev.start_mark)
        cls = type(ev)
        if cls is yaml.ScalarEvent:
            tag = ev.tag
            if tag is None or tag == "!":
                tag = resolve(yaml.ScalarNode, ev.value, ev.implicit)
            node = yaml.ScalarNode(tag, ev.value, ev.start_mark, ev.end_mark, style=ev.style)
            count += 1
            if ev.anchor is not None:
                _anchor(anchors, ev, node, stack)
                sizes[id(node)] = 1
        elif cls is yaml.AliasEvent:
            node = anchors.get(ev.anchor)
            if node is None:
                raise _DocError(_path_of(stack), f"undefined alias *{_key_text(ev.anchor)}",
                                ev.start_mark)
            size = sizes.get(id(node))
            if size is None:
                raise _DocError(_path_of(stack), f"alias *{_key_text(ev.anchor)} refers to "
                                "a node that contains it (a recursive structure)",
                                ev.start_mark)
            count += size
            if count > MAX_VALUES:
                raise _DocError(_path_of(stack), f"aliases expand the document beyond "
                                f"{MAX_VALUES:,} values (an alias bomb?)", ev.start_mark)
        elif cls is yaml.SequenceStartEvent or cls is yaml.MappingStartEvent:
            if len(stack) >= MAX_DEPTH:
                raise _DocError(_path_of(stack), f"nested deeper than {MAX_DEPTH} levels",
                                ev.start_mark)
            kind = yaml.SequenceNode if cls is yaml.SequenceStartEvent else yaml.MappingNode
            tag = ev.tag
            if tag is None or tag == "!":
                tag = resolve(kind, None, ev.implicit)
            node = kind(tag, [], ev.start_mark, None, flow_style=ev.flow_style)
            if ev.anchor is not None:
                _anchor(anchors, ev, node, stack)
            stack.append(_Frame(node, count, kind is yaml.MappingNode, ev.anchor is not None))
            count += 1
            continue
        elif cls is yaml.SequenceEndEvent or cls is yaml.MappingEndEvent:
            frame = stack.pop()
            node = frame.node
            node.end_mark = ev.end_mark
            if frame.anchored:
                sizes[id(node)] = count - frame.start
            if frame.merge:
                merges[id(node)] = frame.merge
        elif cls is yaml.DocumentEndEvent:
            break
        else:  # pragma: no cover - the parser guarantees the event grammar
            raise _DocError(_path_of(stack), f"unexpected {cls.__name__}", ev.start_mark)
        if count > MAX_VALUES:
            raise _DocError(_path_of(stack), f"more than {MAX_VALUES:,} values: not a "
                            "configuration file", ev.start_mark)
        if not stack:
            root = node
            continue
        top = stack[-1]
        if top.keys is None:
            top.node.value.append(node)
        elif top.key is None:
            top.key = node
            _check_key(top, node, stack)
        else:
            if isinstance(top.key, yaml.ScalarNode) and top.key.tag == _MERGE_TAG:
                top.merge = max(top.merge, _merge_depth(node, merges, stack))
            top.node.value.append((top.key, node))
            top.key = None
    ev = get()
    if not isinstance(ev, yaml.StreamEndEvent):
        raise _DocError("", "a second YAML document in the file (only one is read)",
                        ev.start_mark)
    return root


def _anchor(anchors: dict, ev: Any, node: Any, stack: list[_Frame]) -> None:
    if ev.anchor in anchors:
        first = anchors[ev.anchor].start_mark.line + 1
        raise _DocError(_path_of(stack), f"anchor &{_key_text(ev.anchor)} defined twice "
                        f"(first at line {first})", ev.start_mark)
    anchors[ev.anchor] = node


def _check_key(top: _Frame, key: Any, stack: list[_Frame]) -> None:
    """Refuse a key given twice in one mapping: YAML loaders keep the last silently."""
    if isinstance(key, yaml.ScalarNode):
        if key.tag == _MERGE_TAG:
            return
        ident: Any = (key.tag, key.value)
    else:
        ident = id(key)
    assert top.keys is not None
    first = top.keys.get(ident)
    if first is not None:
        raise _DocError(_path_of(stack), f"duplicate key (lines {first.start_mark.line + 1} "
                        f"and {key.start_mark.line + 1}): the second would silently replace "
                        "the first")
    top.keys[ident] = key


def _merge_depth(value: Any, merges: dict[int, int], stack: list[_Frame]) -> int:
    """Depth of the merge-key chain a '<<: value' pair adds (PyYAML flattens recursively)."""
    items = value.value if isinstance(value, yaml.SequenceNode) else [value]
    depth = 1 + max((merges.get(id(v), 0) for v in items), default=0)
    if depth > MAX_DEPTH:
        raise _DocError(_path_of(stack), f"merge keys (<<) chained deeper than {MAX_DEPTH}",
                        value.start_mark)
    return depth


def _find(root: Any, target: Any) -> str:
    """The key path of node ``target`` in the node graph ("" if not found)."""
    todo: list[tuple[Any, str]] = [(root, "")] if root is not None else []
    seen: set[int] = set()
    while todo:
        node, at = todo.pop()
        if node is target:
            return at
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo.extend((v, f"{at}[{i}]") for i, v in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k is target:
                    return at
                key = k.value if isinstance(k, yaml.ScalarNode) else "?"
                todo.append((v, _join(at, _key_text(key))))
    return ""


def _lines(root: Any, paths: list[str]) -> dict[str, int]:
    """{key path: line} for those of ``paths`` found in the node graph: one walk along
    the wanted paths only (a mapping's line is its key's)."""
    wanted = set(paths)
    prefixes = {p[:i] for p in wanted for i in range(len(p) + 1)}
    out: dict[str, int] = {}
    todo: list[tuple[Any, str, int]] = [(root, "", root.start_mark.line + 1)]
    while todo:
        node, at, line = todo.pop()
        if at in wanted:
            out.setdefault(at, line)
        if isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                if (p := f"{at}[{i}]") in prefixes:
                    todo.append((v, p, v.start_mark.line + 1))
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else "?"
                if (p := _join(at, _key_text(key))) in prefixes:
                    todo.append((v, p, k.start_mark.line + 1))
    return out


def read_file(path: str | Path) -> tuple[str, str]:
    """(source name, text) of a configuration file (gemmd.yaml, --web.config.file,
    --gpu-spec), read within MAX_FILE_BYTES: ConfigError for anything else."""
    source = str(path)
    if not source:
        raise ConfigError("''", ["cannot read: the file name is empty"])
    try:
        # O_NONBLOCK: open() of a FIFO would wait for a writer forever (issue 24).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:  # not read_text: /dev/zero would never end
            import stat

            if stat.S_ISFIFO(os.fstat(fd).st_mode) or stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise ConfigError(source, ["cannot read: a named pipe or socket, not a file"])
            os.set_blocking(fd, True)
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(source, [f"cannot read: {e.strerror or e}"]) from e
    except ValueError as e:  # a NUL in the file name
        raise ConfigError(source, [f"cannot read: {e}"]) from e
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(source, [f"larger than {MAX_FILE_BYTES >> 10} KiB: not a "
                                   "configuration file"])
    try:
        return source, raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(source, [f"not UTF-8 text (line {line}): {e}"]) from e


def read_yaml(text: str, source: str) -> tuple[Any, Any]:
    """(data, root node) of one YAML document, within MAX_DEPTH, MAX_VALUES and
    MAX_PARSE_S, duplicate keys refused; every failure is a ConfigError."""
    deadline = clock() + MAX_PARSE_S
    try:
        try:
            return _read(_Loader, text, deadline)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e)
            if _Loader is _PyLoader or not _LIBYAML_NESTING.search(problem):
                raise
            raise _nesting_problem(text, e, deadline) from e
    except _DocError as e:
        line = e.mark.line + 1 if e.mark is not None else None
        raise ConfigError(source, [_problem(e.path, e.msg, line)]) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}: "
        elif isinstance(e, yaml.reader.ReaderError):  # position: bytes (libyaml), else chars
            if _Loader is _PyLoader:
                line = text[:e.position].count("\n") + 1
            else:
                line = text.encode("utf-8", "replace")[:e.position].count(b"\n") + 1
            where = f"line {line}: "
        else:
            where = ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(source, [f"{where}invalid YAML: {problem}"]) from e
    except RecursionError as e:  # a bound above was missed; still no traceback
        raise ConfigError(source, [f"nested too deeply (limit {MAX_DEPTH})"]) from e


def _read(loader_class: type, text: str, deadline: float) -> tuple[Any, Any]:
    """read_yaml with one parser; a _DocError carries its key path."""
    loader, root = loader_class(text), None  # the pure-Python reader checks every character
    try:
        root = _compose(loader, deadline)
        return (None if root is None else loader.construct_document(root)), root
    except _DocError as e:
        if e.node is not None:
            e.path = _find(root, e.node)
        raise
    finally:
        loader.dispose()


# libyaml 0.2.6 (in PyYAML 6.0.4's wheels) refuses nesting deeper than 1,000 levels itself:
# "exceeded maximum nesting depth", no key path. Its scanner reads up to 1,024 characters
# ahead of the events gemmd composes (a flow collection may turn out to be a mapping key),
# so "[[[[..." on one line reaches that limit before _compose sees level MAX_DEPTH + 1.
_LIBYAML_NESTING = re.compile(r"nesting", re.IGNORECASE)


def _nesting_problem(text: str, e: yaml.YAMLError, deadline: float) -> _DocError:
    """gemmd's own problem for a document libyaml refused as nested too deeply: the
    pure-Python parser, which has no such limit of its own, reads it again and meets
    MAX_DEPTH (< libyaml's 1,000) first, at the same place as on any other PyYAML."""
    try:
        _read(_PyLoader, text, deadline)
    except _DocError as found:
        return found
    except yaml.YAMLError:
        pass
    # Not expected (libyaml counts the same collections); still gemmd's message, at
    # libyaml's position.
    return _DocError("", f"nested deeper than {MAX_DEPTH} levels",
                     getattr(e, "problem_mark", None))


def unreadable(name: str) -> str | None:
    """Why the file ``name`` cannot be read as a certificate or key (None: it can). Only
    regular files: OpenSSL's open() of a FIFO waits for a writer forever, and a device
    never ends."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open() waits otherwise
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        return str(getattr(e, "strerror", None) or e)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            return os.strerror(errno.EISDIR)
        if not stat.S_ISREG(mode):
            return "not a regular file" + (" (a named pipe)" if stat.S_ISFIFO(mode) else "")
        os.read(fd, 1)
    except OSError as e:
        return str(e.strerror or e)
    finally:
        os.close(fd)
    return None


def ssl_reason(e: Exception) -> str:
    if isinstance(e, ssl.SSLError) and e.reason:
        return f"{e.library or 'SSL'}: {e.reason}"
    return getattr(e, "strerror", None) or str(e)
