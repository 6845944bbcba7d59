"""The drop-in cumulative ops' machinery behind ``fscan.cumsum`` & co.

``rules`` says which path a call takes (torch's op, the C++ kernel, the blocked
scan); ``blocked`` is the blocked parallel scan.
"""
