"""The package layout (docs/architecture.md, "Layout"): each folder sits on a
layer and imports only from the layers below it, whether the import is at the
top of a file or inside a function. Entry points (`__main__.py` files and the
code under `if __name__ == "__main__":`) are exempt: nothing imports them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top. A folder may import its own layer's folders only where listed in SIDEWAYS.
LAYERS = [
    {"errors", "files", "ranks", "configs"},  # configs: the YAML presets (a package only to ship them)
    {"memory.fast"},  # the memory read's kernels and custom ops: a folder of its own below the layers
    {"memory"},
    {"model", "data", "generation"},  # generation: decoding, on any model the caller hands it
    {"finetune"},  # what a fine-tune trains: its config section, modes, slot selection and background
    {"config"},
    {"distributed"},
    {"checkpoint"},
    {"hf"},
    {"evals"},
    {"train"},
    {"plan"},
    {"launch"},
    {"studies", "generate"},
]
# Sub-packages that are folders of their own (their own layer and share of the code).
NESTED = {"memory.fast"}
SIDEWAYS: set[tuple[str, str]] = {("files", "errors")}  # OutputError: a refused output path
SKIP = {"tests", "bench", "docs", "configs", ".venv", "runs", "data_cache", ".git", "build", "memlm.egg-info"}


def _layer(folder: str) -> int:
    return next(i for i, group in enumerate(LAYERS) if folder in group)


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or rel.parts[0].startswith(".") or path.name == "__main__.py":  # .venv, .official
            continue
        yield rel, ".".join(rel.with_suffix("").parts)


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _imports(tree: ast.AST):
    """(imported memlm module, line) of every import outside a main guard."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if _is_main_guard(child):
                continue
            if isinstance(child, ast.Import):
                yield from ((a.name, child.lineno) for a in child.names if a.name.startswith("memlm."))
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("memlm."):
                if child.module in ("memlm.hf", "memlm.distributed", "memlm.plan") or child.module.count(".") == 1:
                    # `from memlm.x import y` may name a submodule y
                    yield from ((f"{child.module}.{a.name}", child.lineno) for a in child.names)
                else:
                    yield child.module, child.lineno
            stack.append(child)


def _folder(module: str) -> str:
    """memlm.memory.fast.ops -> memory.fast (nested); memlm.train.trainer -> train; memlm.errors -> errors."""
    parts = module.split(".")[1:]
    dotted = ".".join(parts[:2])
    return dotted if dotted in NESTED else parts[0]


def test_no_folder_imports_from_a_folder_above_it():
    upward = []
    for rel, name in _modules():
        own = _folder(f"memlm.{name}")
        for target, line in _imports(ast.parse((ROOT / rel).read_text())):
            other = _folder(target)
            if other == own or (own, other) in SIDEWAYS:
                continue
            if _layer(other) >= _layer(own):
                upward.append(f"{rel}:{line} ({own}) imports {target} ({other})")
    assert not upward, "imports that run upward or sideways:\n" + "\n".join(upward)


def test_every_folder_is_on_a_layer_and_none_holds_much_of_the_code():
    lines: dict[str, int] = {}
    for rel, _ in _modules():
        folder = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        folder = ".".join(rel.parts[:2]) if ".".join(rel.parts[:2]) in NESTED else folder
        if folder == "__init__":
            continue
        _layer(folder)  # StopIteration: a new folder without a layer
        lines[folder] = lines.get(folder, 0) + len((ROOT / rel).read_text().splitlines())
    total = sum(lines.values())
    big = {f: round(n / total, 3) for f, n in lines.items() if n > 0.16 * total}
    assert not big, f"folders over 16% of the code lines: {big}"


def test_a_checkpoint_names_no_memlm_module(tmp_path):
    """Moving a module cannot break a saved run's resume: no file of a
    checkpoint refers to a memlm module (DCP's pickled metadata names only
    torch and builtins; the rest is tensors, JSON and config.yaml)."""
    import pickle

    from memlm.config.run import compose
    from memlm.train.trainer import Trainer

    Trainer(compose(["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "memory=memplus",
                     "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4", "steps=1",
                     "logging.wandb.mode=disabled", f"dump_dir={tmp_path}"])).fit()
    (step,) = (tmp_path / "checkpoints").glob("step_*")
    named: set[str] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            named.add(module)
            return super().find_class(module, name)

    with open(step / ".metadata", "rb") as fh:
        Recorder(fh).load()
    assert named and not [m for m in named if m.split(".")[0] == "memlm"], sorted(named)
    for path in step.iterdir():
        if path.suffix != ".yaml":
            assert b"memlm." not in path.read_bytes(), path.name
