"""stacklm's parts inside other trainers: each folder here composes the lesson from above.

Imports from stacklm: nothing.
"""
