"""IKBO ranking model, request contract and server helpers (no tritonserver imports here)."""
