"""Ticket triage around the model: llmstream's user functions example (docs/user-functions.md)."""

LABELS = ("billing", "bug", "account", "other")


def build_request(ticket: dict) -> dict | None:
    """A support ticket -> the chat call that labels it; a closed ticket needs no call."""
    if ticket.get("status") == "closed":
        return None
    tier = ticket.get("tier", "free")
    return {
        "id": str(ticket["ticket_id"]),
        "messages": [
            {"role": "system", "content": f"Label the ticket as one of: {', '.join(LABELS)}. Answer with one word."},
            {"role": "user", "content": f"[{tier} customer] {ticket['subject']}\n\n{ticket['body']}"},
        ],
        "params": {"max_tokens": 4 if tier == "free" else 16},
    }


def to_output(ticket: dict, result: dict | None) -> dict:
    """The team's own output record: the ticket, its label, and whether the model gave one."""
    answer = ((result or {}).get("output") or "").strip().lower()
    label = next((name for name in LABELS if answer.startswith(name)), "other")
    return {"ticket_id": ticket["ticket_id"], "label": label, "confidence": 1.0 if answer.startswith(label) else 0.0}
