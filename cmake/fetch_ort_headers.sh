#!/usr/bin/env bash
# Fetch the ONNX Runtime C/C++ headers (Debian trixie's libonnxruntime-dev, API 21) into DEST.
# No PyPI wheel of onnxruntime ships its headers. The Debian mirror is taken from this
# machine's own apt configuration (nothing is installed; the .deb is only unpacked).
# usage: fetch_ort_headers.sh DEST      -> DEST/include/onnxruntime/onnxruntime_c_api.h
set -euo pipefail
dest=${1:?usage: fetch_ort_headers.sh DEST}
if [[ -f $dest/include/onnxruntime/onnxruntime_c_api.h ]]; then exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/parts" "$work/lists/partial" "$work/archives/partial"
src=""
for f in /etc/apt/sources.list.d/*.sources; do
  [[ -f $f ]] && grep -q '^URIs:.*debian' "$f" && { src=$f; break; }
done
if [[ -n $src ]]; then
  # First stanza whose URIs name the main archive (not -security), with its suite set to trixie.
  awk 'BEGIN{RS=""; ORS="\n\n"} /URIs:/ && !/security/ {print; exit}' "$src" \
    | sed -E 's/^Suites:.*/Suites: trixie/' > "$work/parts/trixie.sources"
else
  uri=$(grep -hE '^deb +(\[[^]]*\] +)?https?://' /etc/apt/sources.list 2>/dev/null \
        | grep -v security | head -n1 | awk '{for(i=2;i<=NF;i++) if ($i ~ /^https?:/) {print $i; exit}}')
  [[ -n $uri ]] || { echo "fetch_ort_headers: no Debian apt source configured on this machine;" \
                         "set HO_ONNX_ORT_INCLUDE_DIR to a folder holding onnxruntime_c_api.h" >&2; exit 1; }
  printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$uri" > "$work/parts/trixie.sources"
fi
opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/parts"
      -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives"
      -o Debug::NoLocking=1 -o APT::Sandbox::User=root -q)
apt-get "${opts[@]}" update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; exit 1; }
(cd "$work" && apt-get "${opts[@]}" download libonnxruntime-dev >"$work/download.log" 2>&1) \
  || { cat "$work/download.log" >&2; exit 1; }
deb=$(ls "$work"/libonnxruntime-dev_*.deb | head -n1)
mkdir -p "$work/x" "$dest/include"
dpkg-deb -x "$deb" "$work/x"
cp -r "$work/x/usr/include/onnxruntime" "$dest/include/"
basename "$deb" > "$dest/SOURCE"
echo "fetch_ort_headers: unpacked $(basename "$deb") into $dest" >&2
