#!/usr/bin/env bash
# Put an older commit's tree in .old/ (git-ignored) for `bench/h200.sh ab`, which times it
# against the working tree on the device: carry ".old" with that call.
#   bash bench/ab_tree.sh main      # e.g. on a branch, to time the branch against main
# The package's layers live in dsl/, codegen/, kernels/ (pyproject's package-dir), so they are
# copied under .old/compilemask/ for a plain PYTHONPATH import of the old tree.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
git worktree remove --force .old 2>/dev/null || rm -rf .old
git worktree prune
git worktree add -q --detach .old "${1:?usage: bash bench/ab_tree.sh COMMIT}"
for d in dsl codegen kernels; do rm -rf ".old/compilemask/$d"; cp -r ".old/$d" ".old/compilemask/$d"; done
echo ".old = $(git -C .old rev-parse --short HEAD)"
