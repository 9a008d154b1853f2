"""YAML for cluster.yaml: PyYAML's safe loader, minus its surprises.

yaml.safe_load takes the last of two equal keys without a word (so
`host_key_policy: strict` followed by `host_key_policy: accept-new` means
accept-new), recurses once per nesting level (5,000 `[` end in a
RecursionError), and turns a 5,000-digit number into a ValueError about
Python's int limits. Here each of those is a `YAMLFileError` with the line and
column, which load_cluster turns into one line.

YAML 1.1 also reads the plain keys `on`, `off`, `yes`, `no`, `y`, `n`, `true`
and `false` as booleans, so `notify: {on: [failed]}` would hold the key True.
In fabtrain's files a key is a name, never a boolean: such keys stay text.
Values are untouched (`enabled: yes` is still true).
"""
from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

# cluster.yaml needs five levels (job.pserver.command inside a list of nodes is
# the deepest); anything past this is a mistake or an attack, not a config.
MAX_DEPTH = 64
# An integer this long is not a port, a count or a timeout; longer text that
# happens to be digits can be quoted. Also keeps yaml's base-60 ints linear.
MAX_INT_CHARS = 100
BOOL_TAG = "tag:yaml.org,2002:bool"
STR_TAG = "tag:yaml.org,2002:str"
MERGE_TAG = "tag:yaml.org,2002:merge"


class YAMLFileError(yaml.MarkedYAMLError):
    """One of our refusals; load_cluster prints `line L, column C: <problem>`."""


class StrictLoader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YAMLFileError(problem=f"nested more than {MAX_DEPTH} levels deep",
                                    problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, MappingNode):
            _keys_are_names(node)
            self._refuse_duplicate_keys(node)
        try:
            return super().construct_mapping(node, deep=deep)
        except YAMLFileError as e:
            # Name the key whose value was refused: "port: a number 5000 characters long".
            for key_node, value_node in node.value:
                if value_node.start_mark is e.problem_mark and isinstance(key_node, ScalarNode):
                    e.problem = f"{key_node.value}: {e.problem}"
            raise

    def _refuse_duplicate_keys(self, node: MappingNode) -> None:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            # `<<: *base` merges keys that the mapping may then override: that is
            # the point of a merge, not a duplicate.
            if not isinstance(key_node, ScalarNode) or key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=False)
            try:
                seen = first_line.get(key)
            except TypeError:  # unhashable: the safe constructor says so itself
                continue
            line = key_node.start_mark.line + 1
            if seen is not None:
                raise YAMLFileError(problem=f"duplicate key {_short(key)} (first given on line {seen})",
                                    problem_mark=key_node.start_mark)
            first_line[key] = line

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if len(text) > MAX_INT_CHARS:
            raise YAMLFileError(problem=f"a number {len(text)} characters long "
                                        f"(at most {MAX_INT_CHARS}; quote it if it is text)",
                                problem_mark=node.start_mark)
        try:
            return super().construct_yaml_int(node)
        except ValueError as e:
            raise YAMLFileError(problem=f"not a valid integer: {e}", problem_mark=node.start_mark) from None


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)


def _keys_are_names(node: MappingNode) -> None:
    for key_node, _ in node.value:
        if isinstance(key_node, ScalarNode) and key_node.tag == BOOL_TAG and key_node.style is None:
            key_node.tag = STR_TAG


def load_yaml(text: bytes | str) -> Any:
    """Parse one YAML document; raises yaml.YAMLError (with a mark where there is one)."""
    return load_yaml_with_lines(text)[0]


def load_yaml_with_lines(text: bytes | str) -> tuple[Any, dict[str, int]]:
    """One YAML document, and the line (1-based) each field starts on, by its dotted
    name as the cluster parser writes it: `nodes[1].roles`, `job.watchdog.notify.on`."""
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines = field_lines(node)
        return loader.construct_document(node), lines
    finally:
        loader.dispose()


def field_lines(root) -> dict[str, int]:
    """Every key and list item under `root`, once each (an alias is not walked again,
    so a small file of aliases cannot make this large)."""
    lines: dict[str, int] = {}
    seen: set[int] = set()
    todo = [(root, "")]
    while todo:
        node, where = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, ScalarNode) and key_node.tag != MERGE_TAG:
                    name = f"{where}.{key_node.value}" if where else key_node.value
                    lines.setdefault(name, key_node.start_mark.line + 1)
                    todo.append((value_node, name))
        elif isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                name = f"{where}[{i}]"
                lines.setdefault(name, item.start_mark.line + 1)
                todo.append((item, name))
    return lines


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"

