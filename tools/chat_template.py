#!/usr/bin/env python3
"""Chat and instruction records -> segments for `shardtrain data encode` (docs/data.md, "Chat and
instruction data"). A data-preparation step in Python because the templates are Jinja, and no
well-kept Jinja engine exists for C++: it needs jinja2 (`pip install jinja2`, or Debian's
python3-jinja2), nothing else.

Input: JSON Lines, one record per line, in the forms TRL's SFTTrainer takes:
  {"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}    conversational
  {"prompt": [messages], "completion": [messages]}                            conversational prompt-completion
  {"prompt": "...", "completion": "..."}                                      plain prompt-completion
Output: one {"segments": [{"text": "...", "train": true|false}, ...]} per record, the segments
concatenated being exactly the text the model's chat template renders for the record (as
transformers' apply_chat_template renders it), "train" true on the parts the model should learn to
write: each assistant turn as the template writes it (its end-of-turn token included), or the
completion. Plain prompt-completion records are not templated: the prompt, then the completion
followed by the tokenizer's end-of-sequence token, as TRL does.

The assistant turns are found as TRL finds a completion: the conversation up to an assistant turn,
rendered with add_generation_prompt, must be the beginning of the conversation rendered with that
turn, which must be the beginning of the whole. A template that rewrites earlier turns (one that drops
past reasoning, for example) fails this with an error naming the record.

The template comes from --model's tokenizer_config.json ("chat_template", a string or the "default"
of a list) or its chat_template.jinja, or from --template. It is rendered as transformers renders it:
a sandboxed environment with trim_blocks and lstrip_blocks, the loop-controls extension,
raise_exception() and strftime_now(), tojson without ASCII escapes, the tokenizer's special tokens
(bos_token, eos_token, ...) as variables, and {% generation %} blocks rendered as their contents.
"""
import argparse
import json
import os
import sys
from datetime import datetime


def fail(message):
    sys.exit(f"chat_template: error: {message}")


def token_text(value):
    """A special token of tokenizer_config.json: a string, or an AddedToken written as a dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_template(model, template_file):
    """The template text and the special-token variables."""
    config = {}
    config_path = os.path.join(model, "tokenizer_config.json") if model else None
    if config_path and os.path.exists(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            fail(f"{config_path}: cannot read it as JSON ({e})")
    variables = {}
    for key, value in config.items():
        if key.endswith("_token") and token_text(value) is not None:
            variables[key] = token_text(value)
    if template_file:
        with open(template_file, encoding="utf-8") as f:
            return f.read(), variables
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    jinja_file = os.path.join(model, "chat_template.jinja") if model else None
    if template is None and jinja_file and os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    if not isinstance(template, str):
        fail(f"model folder '{model}' has no chat template (tokenizer_config.json's \"chat_template\" or "
             "chat_template.jinja); give one with --template FILE")
    return template, variables


def compile_template(text):
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        fail("needs the jinja2 package: pip install jinja2 (or apt-get install python3-jinja2)")

    class GenerationBlocks(Extension):
        """{% generation %}...{% endgeneration %} marks assistant text for transformers' masks; the
        segments here come from the prefixes instead, so the block renders as its contents."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text), jinja2.exceptions.TemplateError
    except jinja2.exceptions.TemplateError as e:
        fail(f"the chat template does not compile: {e}")


class Renderer:
    def __init__(self, template, variables, error_type):
        self.template, self.variables, self.error_type = template, variables, error_type

    def __call__(self, messages, generation_prompt, where, extra):
        try:
            return self.template.render(messages=messages, add_generation_prompt=generation_prompt,
                                        **self.variables, **extra)
        except self.error_type as e:
            fail(f"{where}: the chat template failed: {e}")


def check_messages(messages, where):
    if not isinstance(messages, list) or not messages:
        fail(f"{where}: expected a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            fail(f"{where}: message {i} is not {{\"role\": ..., \"content\": ...}}")


def prefix_of(shorter, longer, what, where):
    if not longer.startswith(shorter):
        fail(f"{where}: the chat template renders {what} differently inside the longer conversation, so the "
             "assistant's part cannot be found (a template that rewrites earlier turns); train on whole texts "
             "instead, or use a template that keeps earlier turns as they were")


def conversation_segments(render, messages, where, extra):
    """Untrained and trained pieces of a conversation: each assistant turn is trained."""
    check_messages(messages, where)
    whole = render(messages, False, where, extra)
    segments, done = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], True, where, extra)
        with_turn = render(messages[:i + 1], False, where, extra)
        prefix_of(prompt, with_turn, f"the conversation before message {i}", where)
        prefix_of(with_turn, whole, f"the conversation up to message {i}", where)
        if len(prompt) < done:
            fail(f"{where}: the chat template's generation prompt for message {i} overlaps the turn before it")
        segments += [(whole[done:len(prompt)], False), (whole[len(prompt):len(with_turn)], True)]
        done = len(with_turn)
    segments.append((whole[done:], False))
    return segments


def record_segments(render, record, eos, where):
    extra = {key: record[key] for key in ("tools", "documents") if key in record}
    if "messages" in record:
        return conversation_segments(render, record["messages"], where, extra)
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if eos is None:
                fail(f"{where}: a plain completion ends with the tokenizer's eos_token, and the model folder's "
                     "tokenizer_config.json names none")
            return [(prompt, False), (completion + ("" if completion.endswith(eos) else eos), True)]
        check_messages(prompt, where + " prompt")
        check_messages(completion, where + " completion")
        start = render(prompt, True, where, extra)
        whole = render(prompt + completion, False, where, extra)
        prefix_of(start, whole, "the prompt", where)
        return [(start, False), (whole[len(start):], True)]
    fail(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\": ..., \"completion\": ...}}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hugging Face model folder with tokenizer_config.json (the template and "
                        "the special tokens)")
    parser.add_argument("--template", help="a Jinja chat template file instead of the model folder's")
    parser.add_argument("--input", required=True, help="JSON Lines of chat or instruction records")
    parser.add_argument("--output", required=True, help="JSON Lines of segments for shardtrain data encode")
    args = parser.parse_args()
    if not args.model and not args.template:
        fail("give --model FOLDER (its tokenizer_config.json's chat template) or --template FILE")
    text, variables = load_template(args.model, args.template)
    template, error_type = compile_template(text)
    render = Renderer(template, variables, error_type)
    records = trained_chars = all_chars = 0
    tmp = args.output + ".tmp"
    try:
        with open(args.input, encoding="utf-8") as source, open(tmp, "w", encoding="utf-8") as out:
            for line_no, line in enumerate(source, 1):
                if not line.strip():
                    continue
                where = f"{args.input} line {line_no}"
                try:
                    record = json.loads(line)
                except ValueError as e:
                    fail(f"{where}: malformed JSON ({e})")
                if not isinstance(record, dict):
                    fail(f"{where}: expected a JSON object")
                pieces = [(t, trained) for t, trained in record_segments(render, record, variables.get("eos_token"),
                                                                         where) if t]
                out.write(json.dumps({"segments": [{"text": t, "train": trained} for t, trained in pieces]},
                                     ensure_ascii=False) + "\n")
                records += 1
                all_chars += sum(len(t) for t, _ in pieces)
                trained_chars += sum(len(t) for t, trained in pieces if trained)
        os.replace(tmp, args.output)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        fail(str(e))
    print(f"wrote {args.output}: {records} records, {trained_chars} of {all_chars} characters trained "
          f"({100 * trained_chars / max(all_chars, 1):.1f}%)")


if __name__ == "__main__":
    main()
