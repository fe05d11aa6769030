#!/usr/bin/env bash
# The wheels `bash bench/h200.sh setup` installs on the GPU machine (Python 3.12, x86-64), which has torch,
# triton, transformers, numpy and tokenizers but not the service's dependencies:
#
#   bash bench/gpu-wheels.sh            from the source root; writes .gpu/whl-a, .gpu/whl-b, .gpu/whl-c (ignored)
#
# The service's pure-Python dependencies with theirs, xgrammar and apache-tvm-ffi (which xgrammar imports),
# gguf, jsonschema and pytest for the GPU tests, and py-spy for profiling there. One device call carries at most
# 64 MiB with the source tree (about 15 MiB), so the model (which ../shared/tools/gpu-prep leaves in two parts,
# .gpu/model-a and .gpu/model-b) is cut again into three of at most 40 MB (.gpu/model-a, -b, -c) and the wheels
# come in three parts; setup installs the wheels once whl-c has arrived and joins the model once model-c has:
#
#   call 1  carry [".gpu/model-a", ".gpu/whl-a"]                bash bench/h200.sh setup
#   call 2  carry [".gpu/model-b"]                              bash bench/h200.sh setup
#   call 3  carry [".gpu/model-c", ".gpu/whl-b", ".gpu/whl-c"]  bash bench/h200.sh setup STAGE ...
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qxF ".gpu/" .git/info/exclude 2>/dev/null || echo ".gpu/" >> .git/info/exclude
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q "${plat[@]}" -d "$tmp" 'litestar[standard]>=2.12' 'uvicorn>=0.30' \
  'sqlalchemy[asyncio]>=2.0.30' alembic aiosqlite cryptography rfc8785 prometheus-client msgspec httpx openai \
  'jsonschema==4.26.0' 'pytest>=8' pytest-asyncio pytest-timeout psutil
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" 'xgrammar==0.2.9' apache-tvm-ffi gguf py-spy
rm -rf .gpu/whl-a .gpu/whl-b .gpu/whl-c
mkdir -p .gpu/whl-a .gpu/whl-b .gpu/whl-c
# largest first: whl-a up to 9.5 MB (it rides with the model's 44 MB part), whl-b up to 24 MB, whl-c the rest
python3 - "$tmp" <<'PY'
import os, shutil, sys
src = sys.argv[1]
room = {"a": 9.5e6, "b": 24e6, "c": float("inf")}
for name in sorted(os.listdir(src), key=lambda n: -os.path.getsize(os.path.join(src, n))):
    size = os.path.getsize(os.path.join(src, name))
    part = next(p for p in "abc" if size <= room[p])
    room[part] -= size
    shutil.copy(os.path.join(src, name), f".gpu/whl-{part}/")
PY
# the model in three parts of at most 40 MB (part-aa, part-ab, part-ac), from gpu-prep's two or from these three
if [ ! -d .gpu/model-c ] || [ "$(stat -c %s .gpu/model-a/part-aa)" -gt 40000000 ]; then  # (gpu-prep ran again)
  cat .gpu/model-a/part-* .gpu/model-b/part-* > "$tmp/model.gguf"
  rm -rf .gpu/model-a .gpu/model-b
  mkdir -p .gpu/model-a .gpu/model-b .gpu/model-c
  split -b 40000000 -a 2 "$tmp/model.gguf" "$tmp/part-"
  mv "$tmp/part-aa" .gpu/model-a/ && mv "$tmp/part-ab" .gpu/model-b/ && mv "$tmp/part-ac" .gpu/model-c/
fi
du -sh .gpu/whl-a .gpu/whl-b .gpu/whl-c .gpu/model-a .gpu/model-b .gpu/model-c
