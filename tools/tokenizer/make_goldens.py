#!/usr/bin/env python3
"""Golden ids for ml4's tokenizer tests, produced by mistral-common (tiktoken underneath).

    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install mistral-common==1.13.1 tiktoken==0.14.0
    /tmp/tokvenv/bin/python tools/tokenizer/make_goldens.py \
        --tekken tests/golden/tokenizer/tekken_240911.json --out tests/golden/tokenizer

With --ml4 PATH (the built `ml4` binary) it also trains two small vocabularies with
`ml4 tokenizer train` on train_corpus.txt and records mistral-common's ids on them:
  train_corpus.txt, tekken_trained_v13_1500.json, tekken_trained_v15_512.json, trained_golden.json

Writes:
  encode_golden.json  text (as raw bytes, base64) -> ids, and ids -> decoded text (ignore/keep)
  chat_golden.json    OpenAI-style request -> ids of encode_chat_completion, per tokenizer version
  MANIFEST.json       versions, file hashes and this command

The tekken file shipped with mistral-common (tekken_240911.json, Pixtral-12B/Nemo vocabulary) is
"v3" with no special-token list. Tokenizer versions v7..v15 are exercised on *variants* of it:
the same regular vocabulary with config.version, an explicit special_tokens list (the ranks real
v11+ files use: [ARGS]=32, [CALL_ID]=33, [THINK]=34, [/THINK]=35) and, for v15, a
model_settings_builder. VARIANTS below is written into chat_golden.json so the C++ test builds
byte-identical variants in memory.
"""
import argparse
import base64
import copy
import hashlib
import io
import json
import os
import random
import sys
import tempfile

import numpy as np

import mistral_common
import tiktoken
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.tokens.tokenizers import image as mc_image
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from mistral_common.tokens.tokenizers.tekken import Tekkenizer

# Pixel preprocessing needs OpenCV and does not influence the ids: stub it out.
mc_image.transform_image = lambda image, new_size: np.zeros((3, 1, 1), dtype=np.float32)

DEPRECATED = [t["token_str"] for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]


def special_list(extra_at_32):
    names = list(DEPRECATED) + [f"<SPECIAL_{i}>" for i in range(20, 32)] + extra_at_32
    return [{"rank": i, "token_str": n, "is_control": True} for i, n in enumerate(names)]


IMAGE = {"image_patch_size": 16, "max_image_size": 1024, "spatial_merge_size": 2}
VARIANTS = {
    "v7": {"version": "v7", "special_tokens": special_list([]), "image": IMAGE},
    "v11": {"version": "v11", "special_tokens": special_list(["[ARGS]", "[CALL_ID]"]), "image": IMAGE},
    "v13": {"version": "v13", "special_tokens": special_list(["[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]),
            "image": IMAGE},
    "v15": {"version": "v15",
            "special_tokens": special_list(["[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]",
                                            "[MODEL_SETTINGS]", "[/MODEL_SETTINGS]"]),
            "image": IMAGE,
            "model_settings_builder": {
                "reasoning_effort": {"type": "enum", "accepts_none": True, "default": "none",
                                     "values": ["none", "high"]},
                "json_schema": {"type": "json_schema", "accepts_none": False}}},
}


def make_variant(base, v):
    doc = dict(base)
    doc["config"] = dict(base["config"], version=v["version"])
    doc["special_tokens"] = v["special_tokens"]
    doc["image"] = v["image"]
    if "model_settings_builder" in v:
        doc["model_settings_builder"] = v["model_settings_builder"]
    return doc


# ---------------------------------------------------------------------------------------------
# Encoding corpus: several languages, code, emoji, whitespace runs, numbers, special look-alikes,
# malformed UTF-8 (raw bytes; mistral-common sees bytes.decode("utf-8", "replace")).
def corpus():
    cases = []

    def add(name, data):
        cases.append((name, data if isinstance(data, bytes) else data.encode("utf-8")))

    add("empty", "")
    add("english", "The quick brown fox jumps over the lazy dog. It's 5 o'clock; don't panic!")
    add("english_caps", "HELLO World, McDonald's iPhone XML-HTTPRequest CamelCaseIdentifier ALLCAPS")
    add("french", "Élève, où est la bibliothèque ? Ça coûte 12,50 € — c'est très cher !")
    add("german", "Größenordnung: Die Straße ist über 100 km lang. Übermäßig schön.")
    add("spanish", "¿Dónde está el niño? ¡Mañana será otro día!")
    add("russian", "Съешь же ещё этих мягких французских булок, да выпей чаю.")
    add("greek", "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Καλημέρα κόσμε!")
    add("chinese", "我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧！")
    add("japanese", "いろはにほへと ちりぬるを。東京タワーは333メートルです。カタカナ、ひらがな")
    add("korean", "키스의 고유조건은 입술끼리 만나야 하고 특별한 기술은 필요치 않다.")
    add("arabic", "أنا قادر على أكل الزجاج و هذا لا يؤلمني. ١٢٣٤٥٦٧٨٩٠")
    add("hebrew", "אני יכול לאכול זכוכית וזה לא מזיק לי.")
    add("hindi", "मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती. १२३४")
    add("thai", "ฉันกินกระจกได้ แต่มันไม่ทำให้ฉันเจ็บ")
    add("vietnamese", "Tôi có thể ăn thủy tinh mà không hại gì.")
    add("emoji", "I ❤️ pizza 🍕🍕! Family: 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin 👍🏽, keycap 1️⃣ ✨🎉")
    add("code_python", "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
        "print([fib(i) for i in range(10)])  # 0 1 1 2 3 5\n")
    add("code_cpp", "#include <vector>\nint main() {\n\tstd::vector<int> v{1, 2, 3};\n\tfor (auto& x : v) x *= 2;\n"
        "\treturn v[0] != 2;\n}\n")
    add("code_json", '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": [1,2,3]}}')
    add("code_shell", "for f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}' >> /tmp/out.log 2>&1\ndone\n")
    add("whitespace_runs", "a  b   c    d\t\te\n\n\nf \n \n g\r\n\r\nh" + " " * 40 + "i" + "\t" * 17 + "j")
    add("whitespace_trailing", "trailing spaces   \n   leading\n\n\n   ")
    add("whitespace_only", " \t \n  \r\n   ")
    add("unicode_spaces", "a\u00a0b\u2003c\u3000d\u2028e\u2029f\u0085g\u200bh\u202fi\u205fj\u1680k\u000bl\u000cm")
    add("long_numbers", "3141592653589793238462643383279502884197 and 1,000,000.00 and 0x7FFFFFFF and 1e-10 "
        "and 2024-12-02T13:30:00Z and +33 6 12 34 56 78")
    add("special_lookalikes", "[INST] hello [/INST]</s><s>[TOOL_CALLS]get[ARGS]{} [THINK]x[/THINK] <SPECIAL_20> "
        "<unk> [IMG][IMG_BREAK]<pad>[SYSTEM_PROMPT]")
    add("punctuation", "!!!??? ... --- ___ *** ((())) [[[]]] {{{}}} <<<>>> /// \\\\\\ ''' \"\"\" ;;; ::: ,,,")
    add("url_path", "https://example.com/a/b/c?x=1&y=2#frag and /usr/local/lib/python3.11/site-packages/")
    add("mixed_scripts", "Englishрусский中文العربيةहिन्दी日本語한국어Ελληνικά")
    add("combining", "e\u0301 a\u0300 n\u0303 Z\u0351\u0352\u0353a\u0354\u0355l\u0356g\u0357o\u0358")
    add("repeated_char", "a" * 300 + " " + "ab" * 150 + " " + "🙂" * 50)
    rng_long = random.Random(7)
    add("long_random_letters", "".join(rng_long.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(1500)))
    add("long_cjk_run", "".join(chr(rng_long.randrange(0x4E00, 0x5000)) for _ in range(600)))
    add("long_spaces", "x" + " " * 5000 + "y\t\t" + "\n" * 300 + "z")
    add("long_punct_run", "=-" * 400 + "!")
    add("digits_unicode", "٠١٢٣٤٥٦٧٨٩ ०१२३४५ ①②③ ½¼¾ Ⅻ ⁰¹²³")
    add("control_chars", "a\x00b\x01c\x07d\x1be\x7ff")
    # Malformed UTF-8 as raw bytes.
    add("bad_lone_continuation", b"abc\x80def\xbfghi")
    add("bad_truncated_3byte", b"caf\xc3 and \xe2\x82 euro \xe2\x82\xac")
    add("bad_overlong", b"over\xc0\xafslash \xe0\x80\xaf and \xc1\xbf")
    add("bad_surrogate", b"sur\xed\xa0\x80rogate \xed\xbf\xbf")
    add("bad_too_large", b"big\xf4\x90\x80\x80 \xf5\x80\x80\x80 \xff\xfe")
    add("bad_truncated_end", b"end\xf0\x9f\x98")
    add("bad_mixed", b"\xf0\x9f\x98\x80ok\xf0\x9f\x98\xf0\x9f\x98\x81\xe4\xb8\xad\xe4\xb8")
    rng = random.Random(1234)
    for i in range(8):
        add(f"random_bytes_{i}", bytes(rng.randrange(256) for _ in range(rng.randrange(20, 200))))
    # Random text over blocks that are stable across Unicode 14..16 (both regex engines agree).
    ranges = [(0x20, 0x7E), (0xA0, 0xFF), (0x100, 0x17F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF),
              (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE5B), (0x3040, 0x30FF), (0x4E00, 0x4FFF),
              (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x300, 0x36F), (0x2000, 0x200A), (0x9, 0xD),
              (0x660, 0x669), (0x2460, 0x2473)]
    for i in range(12):
        s = []
        for _ in range(rng.randrange(50, 400)):
            a, b = ranges[rng.randrange(len(ranges))]
            s.append(chr(rng.randrange(a, b + 1)))
            if rng.random() < 0.2:
                s.append(" " * rng.randrange(1, 4))
        add(f"random_text_{i}", "".join(s))
    return cases


def decode_cases(tok, rng):
    """Id sequences mixing regular tokens, lone byte tokens (splitting UTF-8) and specials."""
    cases = []
    n_special = tok.num_special_tokens
    text = "Café 日本語 🍕 naïve — ok\n"
    ids = tok.encode(text, bos=False, eos=False)
    cases.append(ids)
    emoji = "🍕".encode("utf-8")
    byte_ids = [b + n_special for b in emoji]
    cases.append(byte_ids)                                      # one char over four byte tokens
    cases.append(byte_ids[:2] + [1] + byte_ids[2:])             # a special splits a character
    cases.append(byte_ids[:3])                                  # truncated at the end
    cases.append([0xE2 + n_special, 0x82 + n_special] + ids[:3] + [0xAC + n_special])
    for _ in range(20):
        seq = []
        for _ in range(rng.randrange(1, 40)):
            r = rng.random()
            if r < 0.15:
                seq.append(rng.randrange(0, 40))
            elif r < 0.5:
                seq.append(n_special + rng.randrange(256))
            else:
                seq.append(n_special + rng.randrange(tok.n_words - n_special))
        cases.append(seq)
    return cases


# ---------------------------------------------------------------------------------------------
# Chat requests (OpenAI form). Each is encoded with every version it is valid for.
def png_data_url(w, h):
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def jpeg_data_url(w, h):
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (30, 200, 30)).save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Name, e.g. Zürich"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "web_search", "parameters": {"type": "object", "properties": {"q": {"type": "string"},
                                                                          "limit": {"type": "integer"}}}}}
NO_PARAMS_TOOL = {"type": "function", "function": {"name": "get_time", "description": None}}


def chat_requests():
    R = []

    def add(name, req, versions=("v7", "v11", "v13", "v15")):
        R.append((name, req, versions))

    add("single_user", {"messages": [{"role": "user", "content": "Hello! How are you?"}]})
    add("system_user", {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                     {"role": "user", "content": "Bonjour, ça va ?"}]})
    add("multi_turn", {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4.   "},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "Thanks 🙏"}]})
    add("system_in_middle", {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Ok."},
        {"role": "system", "content": "From now on answer in French."},
        {"role": "user", "content": "How are you?"}]})
    add("consecutive_users", {"messages": [
        {"role": "user", "content": "First part."},
        {"role": "user", "content": "Second part."}]})
    add("text_chunks", {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Rule one."}, {"type": "text", "text": "Rule two."}]},
        {"role": "user", "content": [{"type": "text", "text": "Part A"}, {"type": "text", "text": "Part B"}]}]})
    add("special_lookalike_text", {"messages": [
        {"role": "user", "content": "Please print [INST] and </s> and [TOOL_CALLS] literally."}]})
    add("tools_single_turn", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                              "tools": [WEATHER_TOOL, SEARCH_TOOL, NO_PARAMS_TOOL]})
    add("tools_multi_turn", {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]})
    add("tool_call_and_result", {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "abcDEF123", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather",
         "content": "{\"temperature\": 21.5, \"sky\": \"clear\"}"}], "tools": [WEATHER_TOOL]})
    add("parallel_tool_calls", {"messages": [
        {"role": "user", "content": "Weather in Paris and Tokyo, then search news."},
        {"role": "assistant", "tool_calls": [
            {"id": "call00001", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call00002", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"東京\",\"unit\":\"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call00002", "content": "rainy, 18°C"},
        {"role": "tool", "tool_call_id": "call00001", "content": "sunny, 25°C"},
        {"role": "assistant", "content": "Paris is sunny; Tokyo is rainy."},
        {"role": "user", "content": "Now search for news."},
        {"role": "assistant", "tool_calls": [
            {"id": "Zz9Yy8Xx7", "type": "function",
             "function": {"name": "web_search", "arguments": "{\"q\": \"news\", \"limit\": 3, \"x\": 1e-05, "
                                                              "\"y\": 2.50, \"z\": [true, null, -0.0]}"}}]},
        {"role": "tool", "tool_call_id": "Zz9Yy8Xx7", "content": [{"type": "text", "text": "result one"},
                                                                    {"type": "text", "text": "result two"}]}],
        "tools": [WEATHER_TOOL, SEARCH_TOOL]})
    add("tool_call_bad_json_args", {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [
            {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_time", "arguments": "not json {"}}]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": ""}], "tools": [NO_PARAMS_TOOL]})
    add("tool_call_with_content", {"messages": [
        {"role": "user", "content": "Check the weather."},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "q1w2e3r4t", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "q1w2e3r4t", "content": "{\"t\": 3}"}], "tools": [WEATHER_TOOL]})
    add("assistant_prefix", {"messages": [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight"}], "continue_final_message": True})
    add("continue_final_message", {"messages": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two,"}], "continue_final_message": True})
    add("image_png", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": png_data_url(100, 50)}}]}]})
    add("image_two_sizes", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(2048, 600)}},
        {"type": "text", "text": "Compare with"},
        {"type": "image_url", "image_url": {"url": jpeg_data_url(33, 777)}},
        {"type": "text", "text": "please."}]}]})
    add("image_odd_round", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Rounding case"},
        {"type": "image_url", "image_url": {"url": png_data_url(1030, 21)}}]}]})
    add("reasoning_history", {"messages": [
        {"role": "user", "content": "Think, then answer: 17*23?"},
        {"role": "assistant", "reasoning_content": "17*23 = 17*20 + 17*3 = 340 + 51 = 391.", "content": "391"},
        {"role": "user", "content": "And 19*21?"}]}, ("v13", "v15"))
    add("thinking_chunks", {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Think step by step."}]},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Rayleigh scattering..."},
                                          {"type": "text", "text": "Because of Rayleigh scattering."}]},
        {"role": "user", "content": "Thanks."}]}, ("v13", "v15"))
    add("thinking_open_prefix", {"messages": [
        {"role": "user", "content": "Solve x^2=4."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "x = 2 or", "closed": False}]}],
        "continue_final_message": True}, ("v13", "v15"))
    add("reasoning_then_tool", {"messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "reasoning": "Need the tool.", "tool_calls": [
            {"id": "R0me12345", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "R0me12345", "content": "hot"}], "tools": [WEATHER_TOOL]}, ("v13", "v15"))
    add("reasoning_effort_high", {"messages": [{"role": "user", "content": "Prove there are infinitely many primes."}],
                                  "reasoning_effort": "high", "tools": [SEARCH_TOOL]}, ("v15",))
    add("reasoning_effort_none", {"messages": [{"role": "system", "content": "Sys"},
                                               {"role": "user", "content": "Hi"}],
                                  "reasoning_effort": "none"}, ("v15",))
    add("response_format_json", {"messages": [{"role": "user", "content": "Give JSON."}],
                                 "response_format": {"type": "json_object"}, "reasoning_effort": "high"}, ("v15",))
    add("response_format_schema", {"messages": [{"role": "user", "content": "Give a person."}],
                                   "response_format": {"type": "json_schema", "json_schema": {
                                       "name": "person", "schema": {"type": "object", "properties": {
                                           "name": {"type": "string"}, "age": {"type": "integer"}},
                                           "required": ["name"]}}}}, ("v15",))
    add("unicode_everywhere", {"messages": [
        {"role": "system", "content": "Réponds en français. 日本語も可。"},
        {"role": "user", "content": "Quelle est la météo à Zürich ? 🌦️"},
        {"role": "assistant", "tool_calls": [
            {"id": "Zur1ch000", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": "{\"city\": \"Zürich\"}"}}]},
        {"role": "tool", "tool_call_id": "Zur1ch000", "content": "{\"ciel\": \"nuageux\", \"t\": -3}"},
        {"role": "assistant", "content": "Il fait -3 °C et nuageux."},
        {"role": "user", "content": "Merci !"}], "tools": [WEATHER_TOOL]})
    # Requests mistral-common refuses: ml4 must refuse them too (with id rewriting off).
    add("error_bad_call_id", {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], "tools": [NO_PARAMS_TOOL]}, ("v7", "v11"))
    add("error_last_assistant", {"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]})
    add("error_bad_tool_name", {"messages": [{"role": "user", "content": "a"}],
                                "tools": [{"type": "function", "function": {"name": "bad name!"}}]})
    add("error_tool_after_user", {"messages": [{"role": "user", "content": "a"},
                                               {"role": "tool", "tool_call_id": "abcdefghi", "content": "x"}]})
    add("error_effort_unsupported", {"messages": [{"role": "user", "content": "a"}],
                                     "reasoning_effort": "high"}, ("v13",))
    add("error_effort_not_allowed", {"messages": [{"role": "user", "content": "a"}],
                                     "reasoning_effort": "low"}, ("v15",))
    return R


TRAINED = [
    {"file": "tekken_trained_v13_1500.json", "vocab_size": 1500, "num_special": 100, "version": "v13"},
    {"file": "tekken_trained_v15_512.json", "vocab_size": 512, "num_special": 100, "version": "v15"},
]


def make_trained_goldens(ml4, out):
    """Vocabularies trained by `ml4 tokenizer train`, checked by mistral-common."""
    import subprocess
    texts = [data.decode("utf-8", errors="replace") for _, data in corpus()]
    for name, req, _ in chat_requests():
        for m in req["messages"]:
            if isinstance(m.get("content"), str):
                texts.append(m["content"])
    corpus_path = os.path.join(out, "train_corpus.txt")
    with open(corpus_path, "w", encoding="utf-8") as f:
        f.write("\n".join(texts))
    cases = []
    for t in TRAINED:
        path = os.path.join(out, t["file"])
        subprocess.run([ml4, "tokenizer", "train", "--corpus", corpus_path, "--out", path, "--vocab-size",
                        str(t["vocab_size"]), "--num-special", str(t["num_special"]), "--version", t["version"]],
                       check=True)
        mt = MistralTokenizer.from_file(path)
        tok = mt.instruct_tokenizer.tokenizer
        enc = [{"name": n, "bytes_b64": base64.b64encode(d).decode(),
                "ids": tok.encode(d.decode("utf-8", errors="replace"), bos=False, eos=False)} for n, d in corpus()]
        chat = []
        for name, req, versions in chat_requests():
            if t["version"] not in versions or name.startswith("error_") or name.startswith("image"):
                continue
            r = copy.deepcopy(req)
            messages = r.pop("messages")
            tools = r.pop("tools", None)
            request = ChatCompletionRequest.from_openai(messages=messages, tools=tools, **r)
            chat.append({"name": name, "request": req, "ids": mt.encode_chat_completion(request).tokens})
        cases.append({"file": t["file"], "encode": enc, "chat": chat})
    with open(os.path.join(out, "trained_golden.json"), "w", encoding="utf-8") as f:
        json.dump({"trained": TRAINED, "cases": cases}, f, ensure_ascii=False)
        f.write("\n")
    return {"trained_encode": sum(len(c["encode"]) for c in cases), "trained_chat": sum(len(c["chat"]) for c in cases)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tekken", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ml4", help="ml4 binary: also make the trained-vocabulary goldens")
    args = ap.parse_args()

    base = json.load(open(args.tekken, encoding="utf-8"))
    tok = Tekkenizer.from_file(args.tekken)

    enc_cases = []
    for name, data in corpus():
        text = data.decode("utf-8", errors="replace")
        enc_cases.append({"name": name, "bytes_b64": base64.b64encode(data).decode(),
                          "ids": tok.encode(text, bos=False, eos=False)})
    rng = random.Random(99)
    dec_cases = []
    for ids in decode_cases(tok, rng):
        dec_cases.append({"ids": ids, "ignore": tok.decode(ids, SpecialTokenPolicy.IGNORE),
                          "keep": tok.decode(ids, SpecialTokenPolicy.KEEP)})
    with open(os.path.join(args.out, "encode_golden.json"), "w", encoding="utf-8") as f:
        json.dump({"tekken": os.path.basename(args.tekken), "encode": enc_cases, "decode": dec_cases}, f,
                  ensure_ascii=False)
        f.write("\n")

    chat_cases = []
    with tempfile.TemporaryDirectory() as td:
        mts = {}
        for vname, v in VARIANTS.items():
            path = os.path.join(td, f"tekken_{vname}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(make_variant(base, v), f)
            mts[vname] = MistralTokenizer.from_file(path)
        for name, req, versions in chat_requests():
            for vname in versions:
                r = copy.deepcopy(req)
                messages = r.pop("messages")
                tools = r.pop("tools", None)
                try:
                    request = ChatCompletionRequest.from_openai(messages=messages, tools=tools, **r)
                    tokenized = mts[vname].encode_chat_completion(request)
                except Exception as e:  # noqa: BLE001 - any refusal is the expected answer
                    assert name.startswith("error_"), (name, vname, e)
                    chat_cases.append({"name": name, "variant": vname, "request": req, "error": str(e)})
                    continue
                assert not name.startswith("error_"), (name, vname)
                chat_cases.append({"name": name, "variant": vname, "request": req, "ids": tokenized.tokens})
    with open(os.path.join(args.out, "chat_golden.json"), "w", encoding="utf-8") as f:
        json.dump({"tekken": os.path.basename(args.tekken), "variants": VARIANTS, "cases": chat_cases}, f,
                  ensure_ascii=False)
        f.write("\n")

    trained_counts = {}
    if args.ml4:
        trained_counts = make_trained_goldens(args.ml4, args.out)

    def sha(p):
        return hashlib.sha256(open(p, "rb").read()).hexdigest()

    manifest = {
        "command": "tools/tokenizer/make_goldens.py --tekken tests/golden/tokenizer/tekken_240911.json "
                   "--out tests/golden/tokenizer",
        "mistral_common": mistral_common.__version__, "tiktoken": tiktoken.__version__,
        "python": sys.version.split()[0],
        "tekken_source": "mistral_common/data/tekken_240911.json from the mistral-common wheel",
        "files": {n: sha(os.path.join(args.out, n)) for n in
                  ("tekken_240911.json", "encode_golden.json", "chat_golden.json", "train_corpus.txt",
                   "tekken_trained_v13_1500.json", "tekken_trained_v15_512.json", "trained_golden.json") if
                  os.path.exists(os.path.join(args.out, n))},
        "counts": {"encode": len(enc_cases), "decode": len(dec_cases), "chat": len(chat_cases), **trained_counts},
        "trained": TRAINED,
    }
    with open(os.path.join(args.out, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(manifest["counts"])


if __name__ == "__main__":
    main()
