"""A tekken.json as a tiktoken Encoding (the same byte-level BPE: ranks, pre-split regex).

ml4's tokenizer (src/tokenizer) and mistral-common read the same file; tiktoken is used here
because it is on the GPU machine and fast. Ids are tiktoken ranks + num_special_tokens, as
mistral-common's Tekkenizer numbers them; special tokens are never produced from text.
"""

import base64
import json


class Tekken:
    def __init__(self, path):
        import tiktoken
        with open(path) as f:
            t = json.load(f)
        cfg = t["config"]
        self.num_special = cfg["default_num_special_tokens"]
        self.vocab_size = cfg["default_vocab_size"]
        n = self.vocab_size - self.num_special
        ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in t["vocab"][:n]}
        self.enc = tiktoken.Encoding(name="tekken", pat_str=cfg["pattern"], mergeable_ranks=ranks, special_tokens={})
        self.specials = {s["token_str"]: s["rank"] for s in t["special_tokens"]}
        self.bos, self.eos = self.specials["<s>"], self.specials["</s>"]
        self._bytes = [b"" for _ in range(self.vocab_size)]
        for b, r in ranks.items():
            self._bytes[r + self.num_special] = b

    def encode(self, text):
        return [i + self.num_special for i in self.enc.encode_ordinary(text)]

    def encode_batch(self, texts, threads=8):
        return [[i + self.num_special for i in ids] for ids in self.enc.encode_ordinary_batch(texts, num_threads=threads)]

    def token_bytes(self, i):
        return self._bytes[i]

    def decode(self, ids):
        return b"".join(self._bytes[i] for i in ids if i >= self.num_special).decode("utf-8", "replace")
