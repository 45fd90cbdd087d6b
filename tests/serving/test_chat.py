"""Chat templates render as transformers renders them; content parts and template sources."""

import datetime

import pytest

from atlas_jax.data.tokenizer import ByteTokenizer
from atlas_jax.serving import model_files
from atlas_jax.serving.chat import ChatTemplate, ChatTemplateError, PlainChatTemplate

from .hf_folders import CHATML_TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE

TEMPLATES = {
  "chatml": CHATML_TEMPLATE,
  "llama3": LLAMA3_TEMPLATE,
  "mistral": MISTRAL_TEMPLATE,
  # loopcontrols both ways, the {% generation %} tag, tojson of non-ASCII text
  "tags": (
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}{{ m.role }}:{% generation %}{{ m.content }}"
    "{% endgeneration %}|{% endfor %}{{ messages[-1] | tojson }}"
    "{% if add_generation_prompt %}>{% endif %}"
  ),
}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
CHATS = [
  [{"role": "user", "content": "héllo"}],
  [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "c"},
  ],
]


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("chat", [0, 1])
@pytest.mark.parametrize("continue_final", [False, True])
def test_renders_as_transformers(name, chat, continue_final):
  chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
  messages = CHATS[chat]
  if name == "mistral":
    messages = [m for m in messages if m["role"] != "system"]
  options = dict(add_generation_prompt=not continue_final, continue_final_message=continue_final)
  (want,), _ = chat_template_utils.render_jinja_template(
    conversations=[messages], chat_template=TEMPLATES[name], **options, **SPECIAL
  )
  got = ChatTemplate(TEMPLATES[name], special_tokens=SPECIAL, where="test").render(
    messages, **options
  )
  assert got == want
  if name == "llama3":
    assert datetime.date.today().strftime("%d %b %Y") in got  # strftime_now


def test_content_parts_and_nulls():
  template = ChatTemplate("{% for m in messages %}{{ m | tojson }}{% endfor %}", where="test")
  parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
  got = template.render([{"role": "user", "content": parts, "name": None}])
  assert got == '{"role": "user", "content": "a\\nb"}'
  with pytest.raises(ChatTemplateError, match="'messages.0.content.1' of type 'image_url'") as e:
    template.render([{"role": "user", "content": [parts[0], {"type": "image_url"}]}])
  assert e.value.field == "messages.0.content.1"


def test_template_errors_are_the_requests():
  template = ChatTemplate(MISTRAL_TEMPLATE, special_tokens=SPECIAL, where="test")
  with pytest.raises(ChatTemplateError, match="roles must alternate"):
    template.render([{"role": "assistant", "content": "x"}])
  with pytest.raises(ChatTemplateError, match="cannot both be true"):
    template.render(CHATS[0], continue_final_message=True)
  with pytest.raises(ValueError, match="where: not a valid Jinja template"):
    ChatTemplate("{% for %}", where="where")


def test_plain_transcript():
  messages = [{"role": "user", "content": "hi"}]
  assert PlainChatTemplate().render(messages) == "user: hi\nassistant:"
  assert PlainChatTemplate().render(messages, add_generation_prompt=False) == "user: hi\n"


def test_template_sources(tmp_path):
  tok = ByteTokenizer()
  assert model_files.chat_template(tmp_path, tok) is None
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
  assert model_files.chat_template(tmp_path, tok).render(CHATS[0]) == "héllo!"
  # tokenizer_config.json's wins, and its special tokens are the template's
  (tmp_path / "tokenizer_config.json").write_text(
    '{"chat_template": "{{ bos_token }}{{ messages[0].content }}", "bos_token": {"content": "<b>"}}'
  )
  assert model_files.chat_template(tmp_path, tok).render(CHATS[0]) == "<b>héllo"
  # --chat-template: a file, or the template itself
  file = tmp_path / "t.jinja"
  file.write_text("[{{ messages | length }}]")
  assert model_files.chat_template(tmp_path, tok, str(file)).render(CHATS[1]) == "[4]"
  inline = "{{ messages[-1].content }}?"
  assert model_files.chat_template(tmp_path, tok, inline).render(CHATS[1]) == "c?"
  with pytest.raises(ValueError, match="--chat-template='nope.jinja': no such file"):
    model_files.chat_template(tmp_path, tok, "nope.jinja")
