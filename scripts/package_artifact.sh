#!/usr/bin/env bash
# Build the evaluation artifact: dist/specter-artifact-<git sha>.tar.gz
#
#   bash scripts/package_artifact.sh                     # from HEAD and results/reference/
#   OUT=/tmp/dist REFERENCE=results/quick bash scripts/package_artifact.sh
#
# Contents (one top folder, specter-artifact-<sha>/):
#   the source tree at HEAD (git archive: committed files only; uncommitted changes are left out)
#   results/reference/   the reference result CSVs (REFERENCE=<dir>, default results/reference)
#   figures/reference/   every figure and table drawn from them by make_figures.py (SKIP_FIGURES=1: none)
#   ARTIFACT.md, CITATION.cff, .zenodo.json (from HEAD)
#   SHA256SUMS           the manifest: every file of the package and its sha256; verified before packing
#                        with `python scripts/checksums.py verify` (digests AND the file list: a changed,
#                        missing or added file fails; `sha256sum -c SHA256SUMS` checks only the digests)
# Beside the tarball: <name>.tar.gz.sha256. The tarball is reproducible for a given tree (sorted
# names, fixed owner and mtime = the commit time, gzip without a timestamp).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-dist}"
REFERENCE="${REFERENCE:-results/reference}"
PY="${PYTHON:-python}"
sha=$(git rev-parse --short=12 HEAD)
name="specter-artifact-$sha"
mtime=$(git log -1 --format=%ct HEAD)
for f in ARTIFACT.md CITATION.cff .zenodo.json; do
  git cat-file -e "HEAD:$f" 2>/dev/null || { echo "error: $f is not committed at HEAD" >&2; exit 2; }
done
if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
  echo "note: the work tree has uncommitted changes; the package holds HEAD ($sha) only"
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root="$stage/$name"
git archive --format=tar --prefix="$name/" HEAD | tar -x -C "$stage"

if [[ -d "$REFERENCE" ]]; then
  mkdir -p "$root/results/reference"
  # result files only: CSV tables, JSON profiles/environments, YAML configs, Markdown notes
  (cd "$REFERENCE" && find . -type f \( -name '*.csv' -o -name '*.json' -o -name '*.yaml' -o -name '*.md' \) \
     ! -path './logs/*' -print0) | while IFS= read -r -d '' f; do
    mkdir -p "$root/results/reference/$(dirname "$f")"
    cp "$REFERENCE/$f" "$root/results/reference/$f"
  done
  echo "reference results: $REFERENCE -> results/reference/ ($(find "$root/results/reference" -type f | wc -l) files)"
else
  echo "note: no $REFERENCE; the package holds no reference results"
fi
if [[ "${SKIP_FIGURES:-0}" != 1 && -d "$root/results/reference" ]]; then
  (cd "$root" && "$PY" make_figures.py --results results/reference --figures figures/reference) \
    > "$stage/figures.log" 2>&1 || { cat "$stage/figures.log" >&2; echo "error: make_figures.py failed" >&2; exit 1; }
  echo "figures: figures/reference/ ($(find "$root/figures/reference" -name '*.png' | wc -l) PNG)"
fi
find "$root" -name __pycache__ -type d -prune -exec rm -rf {} +

# SHA256SUMS is the manifest: every file of the package, so an added file fails verification too
rm -f "$root/SHA256SUMS"
"$PY" scripts/checksums.py write --dir "$root" > /dev/null
(cd "$root" && sha256sum -c --quiet --strict SHA256SUMS)
"$PY" scripts/checksums.py verify --dir "$root" > /dev/null
echo "SHA256SUMS: $(wc -l < "$root/SHA256SUMS") files, verified (scripts/checksums.py: digests and the file list)"

mkdir -p "$OUT"
tarball="$OUT/$name.tar.gz"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$mtime" -C "$stage" -cf - "$name" | gzip -n -9 > "$tarball"
(cd "$OUT" && sha256sum "$name.tar.gz" > "$name.tar.gz.sha256")
echo "wrote $tarball ($(du -h "$tarball" | cut -f1)) and $tarball.sha256"
echo "check: tar -xzf $tarball && cd $name && python scripts/checksums.py verify"
