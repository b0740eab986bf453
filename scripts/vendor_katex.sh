#!/usr/bin/env bash
# Vendors KaTeX (MIT) into docs/vendor/katex/ so the docs render their mathematics
# offline, with nothing loaded from a CDN. Run it only to update KaTeX; the files it
# writes are committed. Needs npm (the npm registry); takes a few seconds.
#   bash scripts/vendor_katex.sh [VERSION]     (default: the version below)
set -euo pipefail
VERSION="${1:-0.16.47}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/docs/vendor/katex"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent "katex@$VERSION" >/dev/null && tar xzf "katex-$VERSION.tgz")
rm -rf "$DEST"
mkdir -p "$DEST/fonts"
cp "$TMP/package/dist/katex.min.js" "$TMP/package/LICENSE" "$DEST/"
cp "$TMP/package/dist/fonts/"*.woff2 "$DEST/fonts/"
# Every browser the docs target reads woff2: drop the woff/ttf fallbacks from the
# stylesheet so that it names only files that are shipped.
sed -E 's/,url\(fonts\/[A-Za-z0-9_-]+\.woff\) format\("woff"\),url\(fonts\/[A-Za-z0-9_-]+\.ttf\) format\("truetype"\)//g' \
    "$TMP/package/dist/katex.min.css" > "$DEST/katex.min.css"
if grep -qE '\.(woff|ttf)\)' "$DEST/katex.min.css"; then
    echo "vendor_katex: the stylesheet still names woff/ttf fonts; update the sed pattern" >&2
    exit 1
fi
echo "$VERSION" > "$DEST/VERSION"
echo "vendored KaTeX $VERSION into ${DEST#$ROOT/}"
