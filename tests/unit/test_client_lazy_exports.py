"""The library's public names load on first use (``squall.__getattr__``), so a process
that imports only ``squall.v1`` or ``squall.wire`` (every Squall service) does not load
the whole library; what an app writes (``squall.connect``, ``from squall import X``)
works as before."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import squall

INIT = Path(squall.__file__)


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """The names the ``if TYPE_CHECKING:`` block of squall/__init__.py imports."""
    tree = ast.parse(INIT.read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    names: dict[str, tuple[str, str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            names[alias.asname or alias.name] = (node.module, alias.name)
    return names


def test_the_lazy_table_is_the_typed_imports_and_all() -> None:
    imports = _type_checking_imports()
    assert imports == squall._EXPORTS
    assert set(squall.__all__) == set(imports) | {"__version__"}
    for name in squall.__all__:
        assert getattr(squall, name) is not None
        assert name in dir(squall)


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    try:
        squall.Conect  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "module 'squall' has no attribute 'Conect'" in str(exc)
    else:
        raise AssertionError("a misspelt name resolved")


def test_the_generated_code_alone_does_not_load_the_library() -> None:
    code = (
        "import sys, squall.v1.broker_pb2, squall.wire.retry\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('squall._'))\n"
        "assert loaded == ['squall._version'], loaded\n"
        "from squall import connect, Receipt\n"
        "import squall\n"
        "assert squall.connect is connect and 'squall._client' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
