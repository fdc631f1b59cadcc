"""Protections that do not belong to one role: sealed secrets, request signing, egress (SSRF) policy."""
