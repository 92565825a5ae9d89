"""Drafters: n-gram prompt lookup and a separate draft model, behind one interface."""
