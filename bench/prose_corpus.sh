#!/bin/sh
# The recipe bench's prose corpus: the Linux 6.1 kernel documentation's reStructuredText, from Debian's
# linux-doc-6.1 package, tokenized by prepare.py (GPT-2) into shards. Prints the shards' directory.
#
#     sh bench/prose_corpus.sh [OUT]      # OUT default: <cache>/bench/linux-doc-6.1 (cache: $PRETRAIN_CACHE_DIR,
#                                         # else $XDG_CACHE_HOME/pretrain, else ~/.cache/pretrain)
#
# Needs root for apt-get (or the package already installed). The .rst files ship gzipped; they are unpacked into
# OUT.text, in sorted path order, so the val split (the first tokens) is always the same files. OUT/corpus.json
# records how the corpus was made; the bench reads its corpus id from it.
set -eu
case "${1:-}" in -*) sed -n '2,9p' "$0" | cut -c3-; exit 0 ;; esac  # -h, --help: the lines above
cache="${PRETRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pretrain}"
out="$(realpath -m "${1:-$cache/bench/linux-doc-6.1}")"  # before the cd: OUT is the caller's path
cd "$(dirname "$0")/.."
package=linux-doc-6.1
doc=/usr/share/doc/$package/Documentation
max_tokens=8000000   # the anchor reads 4 x 262,144 train tokens: all runs stay within one epoch
val_tokens=262144

if [ -f "$out/corpus.json" ]; then echo "$out"; exit 0; fi
[ -d "$doc" ] || apt-get install -y "$package" >&2
text="$out.text"
if [ -e "$text" ]; then  # never removed unasked: it may be the user's, or a failed run's to look at
    echo "error: $text is in the way (where the text goes): remove it, or give another OUT" >&2; exit 2
fi
find "$doc" -name '*.rst.gz' | LC_ALL=C sort | while read -r f; do
    rel="${f#"$doc"/}"
    mkdir -p "$text/$(dirname "$rel")"
    gzip -dc "$f" > "$text/${rel%.gz}"
done
python prepare.py --input "$text" --out "$out" --tokenizer gpt2 --max-tokens "$max_tokens" \
    --val-tokens "$val_tokens" >&2
version=$(dpkg-query -W -f='${Version}' "$package")
files=$(find "$text" -name '*.rst' | wc -l)
cat > "$out/corpus.json.tmp" <<JSON
{"corpus": "$package $version, Documentation/**/*.rst ($files files, unpacked from .rst.gz)",
 "made_by": "sh bench/prose_corpus.sh: python prepare.py --input $text --tokenizer gpt2 --max-tokens $max_tokens --val-tokens $val_tokens",
 "id": "$package-$version-gpt2-$max_tokens-$val_tokens"}
JSON
mv "$out/corpus.json.tmp" "$out/corpus.json"
rm -rf "$text"
echo "$out"
