#!/usr/bin/env bash
# Splits the second piece of ../shared/vllm-gpu/prepare.sh's offline vLLM install in two, so that
# each device call stays under its 64 MiB with the project's tree beside it (the tree travels with
# every call): .vllm-gpu/piece2 keeps FA3 and the wheels, .vllm-gpu/piece3 gets vLLM's Python
# files. Run it here, once, after prepare.sh; then on the GPU machine, in consecutive calls:
#   carry [".vllm-gpu/piece1", ".vllm-gpu/install_piece.sh"]:  bash .vllm-gpu/install_piece.sh 1
#   carry [".vllm-gpu/piece2", ".vllm-gpu/install_piece.sh"]:  bash .vllm-gpu/install_piece.sh 2
#   carry [".vllm-gpu/piece3", ".vllm-gpu/install_piece.sh", ".deps"]:
#       bash .vllm-gpu/install_piece.sh 3 && bash scripts/gpu/vllm_runs.sh
# install_piece.sh unpacks any piece N the same way (its tarballs, its wheels, its checksums).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
dir=.vllm-gpu
[[ -f $dir/piece2/vllm-python.tar.gz || -f $dir/piece3/vllm-python.tar.gz ]] ||
  { echo "split_vllm_pieces: no $dir/piece2/vllm-python.tar.gz (run ../shared/vllm-gpu/prepare.sh first)" >&2; exit 1; }
chmod -R u+w "$dir"
mkdir -p "$dir/piece3"
if [[ -f $dir/piece2/vllm-python.tar.gz ]]; then
  mv "$dir/piece2/vllm-python.tar.gz" "$dir/piece3/"
fi
(cd "$dir/piece2" && sha256sum -- *.whl *.tar.gz > SHA256SUMS)
(cd "$dir/piece3" && sha256sum -- vllm-python.tar.gz > SHA256SUMS)
for p in piece1 piece2 piece3; do
  echo "split_vllm_pieces: $dir/$p $(($(du -sb "$dir/$p" | cut -f1) / 1024 / 1024)) MiB"
done
