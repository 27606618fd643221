"""infopt.kvcache.quantized_cache: imported by the config module, never importing it back; formulas from primitives."""

import ast
from pathlib import Path

import infopt.kvcache.quantized as config_module
import infopt.kvcache.quantized_cache as cache_module
from infopt.quantize.formats import primitives


def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (``if TYPE_CHECKING:`` blocks left out), relative ones as ``.name``."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_import_circle_between_config_and_cache():
    assert ".quantized" not in _runtime_imports(Path(cache_module.__file__))
    assert ".quantized_cache" in _runtime_imports(Path(config_module.__file__))


def test_one_set_of_formulas():
    # the config module's public names are the cache's and the primitives' functions, not copies
    assert config_module.quantize_groups is cache_module.quantize_groups
    assert config_module.dequantize_groups is cache_module.dequantize_groups
    assert config_module.pack_int4 is primitives.pack_int4
    assert config_module.unpack_int4 is primitives.unpack_int4
