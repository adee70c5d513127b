#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Keeps the three API surfaces in step: C++ (include/weightbus/*.hpp) -> C (weightbus.h) ->
Python (bindings/python/weightbus), against the one table that says where names differ and
what is left out on purpose (tests/api_parity/mapping.toml).

    api_parity.py check         every public C++ call, struct field and enumerator has a C
                                counterpart; every C function, struct field, enumerator and
                                constant has a Python one; the ctypes declarations have the C
                                parameter, return and field types; every mapping entry names
                                something that exists (no stale entries)
    api_parity.py emit-layout   writes a C program printing sizeof/offsetof of every struct of
                                weightbus.h and dlpack.h (CMake builds it as api_layout)
    api_parity.py check-layout  runs that program (or reads its saved output) and compares each
                                size and field offset with the ctypes structs of the package

Exit status 0 when everything matches, 1 with one line per problem otherwise (2 for bad
usage). The parsers read the declarations of documented, clang-formatted headers: statements
split at `;` and balanced braces outside parentheses, comments and preprocessor lines dropped.
They understand what these headers use (namespaces, structs and classes with access labels,
overloads, default arguments, typedef'd C structs, enums and opaque handles, function-pointer
fields) and nothing more; a declaration they cannot read is reported, never skipped silently.

What counts as a counterpart:
  C++ -> C   free functions and public member functions by [cpp_to_c] (overloads are
             Name/N, N the parameter count); fields of structs in [cpp_structs_to_c] match the
             C struct's field of the same name, or with `_ns` appended (durations), else
             [cpp_fields_to_c]; enumerators by [cpp_enums_to_c] (names compared without
             prefix, case and underscores); anything else needs a [cpp_exceptions] reason (a
             key may be a whole class or struct).
  C -> Py    every function must be declared in _lib._SIGNATURES with the ctypes types of its
             C prototype, and map by [c_to_python] to Python objects whose source calls it (a
             module, class attribute, function, method or property; `name(param)` names a
             parameter); struct fields match, through [c_structs_to_python], a dataclass field
             or parameter of the same name (or without `_ns`), else [c_fields_to_python]; a
             field `num_X` just after `X` is X's count and goes with it; struct_size is ABI
             plumbing; enumerators and WB_* integer constants by [c_enums_to_python] and
             [c_constants]; the rest needs a [c_exceptions] reason.
"""
import argparse
import ctypes
import importlib
import inspect
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field, fields as dataclass_fields, is_dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

# ---------------------------------------------------------------------------------------------
# Lexing shared by both parsers
# ---------------------------------------------------------------------------------------------


def strip_comments(text: str) -> str:
    """`text` without // and /* */ comments (string and character literals kept intact)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] != text[i]:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def split_preprocessor(text: str):
    """(text without preprocessor lines, {NAME: replacement} of object-like #defines)."""
    lines, macros, pending = [], {}, ""
    for line in text.split("\n"):
        if pending or line.lstrip().startswith("#"):
            pending += line.rstrip("\\") + " "
            if line.endswith("\\"):
                continue
            m = re.match(r"\s*#\s*define\s+(\w+)(?!\()\s*(.*)", pending)
            if m:
                macros[m.group(1)] = m.group(2).strip()
            pending = ""
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines), macros


def matching_brace(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced braces from offset {start}")


def statements(body: str):
    """The statements of a block: (head, inner) pairs, inner the text between the braces of
    `head { ... }` or None for a statement ending in `;`. Braces after `=` are an initializer
    (part of the statement); braces inside parentheses are default arguments."""
    out, start, i, paren, n = [], 0, 0, 0, len(body)
    while i < n:
        c = body[i]
        if c in "([":
            paren += 1
        elif c in ")]":
            paren -= 1
        elif c == ";" and paren == 0:
            if body[start:i].strip():
                out.append((body[start:i].strip(), None))
            start = i + 1
        elif c == "{" and paren == 0:
            end = matching_brace(body, i)
            head = body[start:i]
            if "=" in re.sub(r"\([^()]*\)", "", head):  # an initializer: the statement goes on
                i = end + 1
                continue
            out.append((head.strip(), body[i + 1:end]))
            i = end + 1
            while i < n and body[i].isspace():
                i += 1
            if i < n and body[i] == ";":
                i += 1
            start = i
            continue
        i += 1
    if body[start:].strip():
        out.append((body[start:].strip(), None))
    return out


def split_top_level(text: str, sep: str = ","):
    """Splits at `sep` outside (), <>, [] and {}."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "(<[{":
            depth += 1
        elif c in ")>]}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


# ---------------------------------------------------------------------------------------------
# The C++ API
# ---------------------------------------------------------------------------------------------

ACCESS = re.compile(r"^\s*(public|private|protected)\s*:(?!:)")


@dataclass
class CppApi:
    functions: dict = field(default_factory=dict)  # key -> declaration
    fields: dict = field(default_factory=dict)     # "Struct.field" -> declaration
    types: dict = field(default_factory=dict)      # "Struct" -> "struct" | "class"
    enums: dict = field(default_factory=dict)      # "Enum" -> [enumerators]
    problems: list = field(default_factory=list)


def _function_name(head: str):
    """(name, parameter count) of a function declaration head, or None."""
    depth = 0
    for i, c in enumerate(head):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0:
            m = re.search(r"(~?[A-Za-z_]\w*)\s*$", head[:i])
            if not m:
                return None
            close = i + 1
            level = 1
            while close < len(head) and level:
                level += {"(": 1, ")": -1}.get(head[close], 0)
                close += 1
            params = split_top_level(head[i + 1:close - 1])
            if params == ["void"]:
                params = []
            return m.group(1), len(params)
    return None


def parse_cpp(paths, api: CppApi = None) -> CppApi:
    api = api or CppApi()
    for path in paths:
        text, _ = split_preprocessor(strip_comments(Path(path).read_text()))
        _parse_cpp_block(text, api, path, scope=None, access="public")
    return api


def _add_function(api, key, arity, decl):
    if key in api.functions or any(k.startswith(key + "/") for k in api.functions):
        if key in api.functions:  # the first overload seen: rename it
            first_decl, first_arity = api.functions.pop(key)
            api.functions[f"{key}/{first_arity}"] = (first_decl, first_arity)
        api.functions[f"{key}/{arity}"] = (decl, arity)
    else:
        api.functions[key] = (decl, arity)


def _parse_cpp_block(text, api, path, scope, access):
    for head, inner in statements(text):
        while True:  # access labels precede the statement they apply to
            m = ACCESS.match(head)
            if not m:
                break
            access = m.group(1)
            head = head[m.end():].strip()
        if not head:
            continue
        flat = normalize(head)
        if inner is not None and re.match(r"namespace\b", flat):
            _parse_cpp_block(inner, api, path, scope, access)
            continue
        if access != "public":
            continue
        m = re.match(r"(struct|class)\s+(?:WB_EXPORT\s+)?(\w+)(\s*:.*)?$", flat)
        if m:
            if inner is None:
                continue  # a forward declaration (class Impl;)
            name = m.group(2) if scope is None else f"{scope}::{m.group(2)}"
            api.types[name] = m.group(1)
            _parse_cpp_block(inner, api, path, name,
                             "public" if m.group(1) == "struct" else "private")
            continue
        m = re.match(r"enum\s+(?:class\s+)?(\w+)", flat)
        if m and inner is not None:
            api.enums[m.group(1)] = [re.match(r"\w+", e).group(0)
                                     for e in split_top_level(strip_comments(inner))]
            continue
        if re.match(r"(using|typedef|friend|template)\b", flat) or "operator" in flat:
            continue
        if re.search(r"=\s*(delete|default)$", flat):
            continue
        parsed = _function_name(flat)
        if parsed:
            name, arity = parsed
            if scope is None and "WB_EXPORT" not in flat:
                continue  # inline helpers and non-exported declarations
            if scope is not None and name.lstrip("~") == scope.split("::")[-1]:
                continue  # constructors and destructors
            _add_function(api, name if scope is None else f"{scope}::{name}", arity, flat)
            continue
        if scope is None:
            if re.match(r"(inline\s+)?(constexpr|const|extern)\b", flat):
                continue  # namespace-level constants (kAllDTypes)
            api.problems.append(f"{path}: cannot read the declaration `{flat[:80]}`")
            continue
        m = re.search(r"([A-Za-z_]\w*)\s*(=.*)?$", flat)
        if not m or inner is not None:
            api.problems.append(f"{path}: cannot read the member `{flat[:80]}` of {scope}")
            continue
        api.fields[f"{scope}.{m.group(1)}"] = flat


# ---------------------------------------------------------------------------------------------
# The C API
# ---------------------------------------------------------------------------------------------


@dataclass
class CType:
    base: str   # e.g. "char", "wb_publisher_t"; "fnptr" for a function pointer
    stars: int

    def __str__(self):
        return self.base + "*" * self.stars


@dataclass
class CApi:
    functions: dict = field(default_factory=dict)  # name -> (CType, [(param, CType)])
    structs: dict = field(default_factory=dict)    # name -> [(field, CType)]
    handles: set = field(default_factory=set)      # opaque typedefs
    enums: dict = field(default_factory=dict)      # name -> {enumerator: value}
    constants: dict = field(default_factory=dict)  # WB_* object-like macros with an int value
    problems: list = field(default_factory=list)


def parse_ctype(decl: str):
    """(name, CType) of `const char* const* names`, `int ndim`, `void (*deleter)(...)`."""
    decl = normalize(decl)
    m = re.match(r".*\(\s*\*\s*(\w+)\s*\)\s*\(.*\)$", decl)
    if m:
        return m.group(1), CType("fnptr", 0)
    m = re.match(r"(.*?)([A-Za-z_]\w*)$", decl)
    if not m:
        return None
    type_text, name = m.groups()
    if not type_text.strip():  # a parameter without a name: the whole text is its type
        type_text, name = decl, ""
    stars = type_text.count("*")
    words = [w for w in re.findall(r"[A-Za-z_]\w*", type_text)
             if w not in ("const", "struct", "enum", "volatile")]
    if len(words) != 1:
        return None
    return name, CType(words[0], stars)


INT_LITERAL = re.compile(r"^\(*\s*(?:\(\s*\w+\s*\))?\s*(-?\d+)[uUlL]*\s*\)*$")


def parse_c(paths, api: CApi = None) -> CApi:
    api = api or CApi()
    for path in paths:
        text, macros = split_preprocessor(strip_comments(Path(path).read_text()))
        for name, value in macros.items():
            m = INT_LITERAL.match(value)
            if name.startswith("WB_") and m:
                api.constants[name] = int(m.group(1))
        _parse_c_block(text, api, path)
    return api


def _parse_c_block(text, api, path):
    for head, inner in statements(text):
        flat = normalize(head)
        if inner is not None and re.match(r'extern\s+"C"', flat):
            _parse_c_block(inner, api, path)
            continue
        m = re.match(r"typedef\s+struct\s+(\w+)\s+(\w+)$", flat)
        if m and inner is None:  # typedef struct wb_publisher wb_publisher_t;
            api.handles.add(m.group(2))
            continue
        if re.match(r"typedef\s+(struct|enum)\b", flat) and inner is not None:
            continue  # a typedef'd body: read below, with the name after its brace
        if inner is None and re.match(r"^\w+$", flat):
            continue  # that name (the statement after the brace)
        if "(" in flat and inner is None and not flat.startswith("typedef"):
            m = re.match(r"(?:WB_EXPORT\s+|DLPACK_EXTERN_C\s+|DLPACK_DLL\s+)*(.*?)\b(\w+)\s*"
                         r"\((.*)\)$", flat)
            if not m:
                api.problems.append(f"{path}: cannot read the function `{flat[:80]}`")
                continue
            ret, name, params = m.groups()
            if "WB_EXPORT" not in flat:
                continue  # not ours (DLPack declares no functions)
            ret_type = parse_ctype(ret + " _")
            parsed = [] if normalize(params) in ("", "void") else [
                parse_ctype(p) for p in split_top_level(params)]
            if ret_type is None or any(p is None for p in parsed):
                api.problems.append(f"{path}: cannot read the types of `{flat[:80]}`")
                continue
            api.functions[name] = (ret_type[1], parsed)
            continue
        api.problems.append(f"{path}: cannot read the declaration `{flat[:80]}`")
    # typedef struct [tag] { ... } Name; and typedef enum [tag] { ... } Name;
    for m in re.finditer(r"typedef\s+(struct|enum)\s*\w*\s*\{", text):
        end = matching_brace(text, m.end() - 1)
        tail = re.match(r"\s*(\w+)\s*;", text[end + 1:])
        if not tail:
            api.problems.append(f"{path}: cannot read the typedef at `{text[m.start():][:60]}`")
            continue
        name, inner = tail.group(1), text[m.end():end]
        if m.group(1) == "enum":
            values, next_value = {}, 0
            for item in split_top_level(inner):
                em = re.match(r"(\w+)\s*(?:=\s*(-?\d+)[uU]?)?$", normalize(item))
                if not em:
                    api.problems.append(f"{path}: cannot read the enumerator `{item}` of {name}")
                    continue
                next_value = int(em.group(2)) if em.group(2) is not None else next_value
                values[em.group(1)] = next_value
                next_value += 1
            api.enums[name] = values
        else:
            fields = []
            for decl, _ in statements(inner):
                parsed = parse_ctype(decl)
                if parsed is None:
                    api.problems.append(f"{path}: cannot read the field `{decl}` of {name}")
                    continue
                fields.append(parsed)
            api.structs[name] = fields


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def _as_list(value):
    return value if isinstance(value, list) else [value]


def _ns_variants(name):
    return [name, name + "_ns"]


def _enum_key(name, prefix):
    name = name[len(prefix):] if prefix and name.startswith(prefix) else name
    return name.replace("_", "").upper()


def _c_name_exists(c: CApi, ref: str) -> bool:
    """A C function, struct, enum, handle, `struct.field` or `function(param)`."""
    m = re.match(r"(\w+)\((\w+)\)$", ref)
    if m:
        return m.group(1) in c.functions and any(p == m.group(2)
                                                 for p, _ in c.functions[m.group(1)][1])
    if "." in ref:
        struct, member = ref.split(".", 1)
        return any(f == member for f, _ in c.structs.get(struct, []))
    return ref in c.functions or ref in c.structs or ref in c.enums or ref in c.handles


def check_cpp_to_c(cpp: CppApi, c: CApi, table: dict) -> list:
    problems = list(cpp.problems) + list(c.problems)
    to_c = table.get("cpp_to_c", {})
    struct_map = table.get("cpp_structs_to_c", {})
    field_map = table.get("cpp_fields_to_c", {})
    enum_map = table.get("cpp_enums_to_c", {})
    exceptions = table.get("cpp_exceptions", {})

    def excepted(key):
        owner = re.split(r"::|\.", key)[0]
        return key in exceptions or owner in exceptions

    for key, refs in to_c.items():
        for ref in _as_list(refs):
            if not _c_name_exists(c, ref):
                problems.append(f"mapping [cpp_to_c] {key} names {ref}, which weightbus.h "
                                "does not declare")
    for key in sorted(cpp.functions):
        if key not in to_c and not excepted(key):
            problems.append(f"C++ {key} ({cpp.functions[key][0][:90]}) has no C counterpart: "
                            "add one to weightbus.h, or a [cpp_to_c] / [cpp_exceptions] entry "
                            "to tests/api_parity/mapping.toml")
    for key in sorted(cpp.fields):
        struct, member = key.split(".", 1)
        if key in field_map:
            for ref in _as_list(field_map[key]):
                if not _c_name_exists(c, ref):
                    problems.append(f"mapping [cpp_fields_to_c] {key} names {ref}, which the C "
                                    "API does not declare")
            continue
        if excepted(key):
            continue
        c_struct = struct_map.get(struct)
        if c_struct and any(_c_name_exists(c, f"{c_struct}.{v}") for v in _ns_variants(member)):
            continue
        where = f"the fields of {c_struct}" if c_struct else "a [cpp_structs_to_c] entry"
        problems.append(f"C++ field {key} ({cpp.fields[key][:80]}) has no C counterpart in "
                        f"{where}: add the field (appended, struct_size rules), or a "
                        "[cpp_fields_to_c] / [cpp_exceptions] entry")
    for struct, c_struct in struct_map.items():
        if struct not in cpp.types:
            problems.append(f"mapping [cpp_structs_to_c] names C++ {struct}, which is not "
                            "declared")
        if c_struct not in c.structs:
            problems.append(f"mapping [cpp_structs_to_c] names {c_struct}, which the C API "
                            "does not declare")
    for enum in sorted(cpp.enums):
        if excepted(enum):
            continue
        spec = enum_map.get(enum)
        if spec is None or spec["c"] not in c.enums:
            problems.append(f"C++ enum {enum} has no C counterpart: add a [cpp_enums_to_c] "
                            "entry naming an enum of the C API")
            continue
        have = {_enum_key(e, spec.get("prefix", "")) for e in c.enums[spec["c"]]}
        for e in cpp.enums[enum]:
            if _enum_key(e, "k") not in have and f"{enum}::{e}" not in exceptions:
                problems.append(f"C++ {enum}::{e} has no enumerator in {spec['c']}")
    for key in list(to_c) + list(field_map):
        if key not in cpp.functions and key not in cpp.fields:
            problems.append(f"mapping entry {key} names no public C++ function or field (stale?)")
    for key in exceptions:
        if (key not in cpp.functions and key not in cpp.fields and key not in cpp.types
                and key not in cpp.enums and not re.match(r"\w+::\w+$", key)):
            problems.append(f"[cpp_exceptions] {key} names nothing in the C++ API (stale?)")
    return problems


def expected_ctype(t: CType, c: CApi, lib_module):
    """The ctypes type a ctypes declaration must use for C type `t`, or a reason string."""
    scalars = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
               "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16,
               "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64,
               "size_t": ctypes.c_size_t, "bool": ctypes.c_bool, "char": ctypes.c_char}
    stars = t.stars
    if t.base in c.handles and stars:
        result, stars = ctypes.c_void_p, stars - 1
    elif t.base == "char" and stars:
        result, stars = ctypes.c_char_p, stars - 1
    elif t.base == "void":
        if not stars:
            return None
        result, stars = ctypes.c_void_p, stars - 1
    elif t.base in c.enums:
        result = ctypes.c_int
    elif t.base in scalars:
        result = scalars[t.base]
    elif t.base in c.structs and hasattr(lib_module, t.base):
        result = getattr(lib_module, t.base)
    else:
        return f"no ctypes type for C type {t}"
    for _ in range(stars):
        result = ctypes.POINTER(result)
    return result


def _type_name(t):
    return "None" if t is None else getattr(t, "__name__", repr(t))


def _wanted(want):
    """An expected_ctype result for a message: the type's name, or why there is none."""
    return want if isinstance(want, str) else _type_name(want)


def _resolve(package, path: str):
    """(object, parameter or None, owner module) of a dotted path inside the package."""
    m = re.match(r"([\w.]+)(?:\((\w+)\))?$", path)
    if not m:
        raise LookupError(f"malformed path {path!r}")
    obj, module = package, package
    parts = m.group(1).split(".")
    if parts[0] == package.__name__:
        parts = parts[1:]
    for part in parts:
        if inspect.ismodule(obj) and not hasattr(obj, part):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
                module = obj
                continue
            except ImportError:
                pass
        if inspect.isclass(obj) and part in obj.__dict__:
            obj = obj.__dict__[part]  # properties and staticmethods themselves
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        elif is_dataclass(obj) and part in {f.name for f in dataclass_fields(obj)}:
            return ("dataclass field", obj, part), None, module
        else:
            raise LookupError(f"{path}: {part!r} not found")
        if inspect.ismodule(obj):
            module = obj
    return obj, m.group(2), module


def _source_of(obj):
    if isinstance(obj, property):
        return "".join(inspect.getsource(f) for f in (obj.fget, obj.fset) if f)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return inspect.getsource(obj)


def _python_counterpart(package, path: str, c_name: str):
    """None when `path` is a counterpart of C `c_name`, else the reason it is not."""
    try:
        obj, param, _ = _resolve(package, path)
    except LookupError as e:
        return str(e)
    if isinstance(obj, tuple):  # a dataclass field
        return None
    if param is not None:
        target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        if inspect.isclass(target):
            target = target.__init__
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            return f"{path}: no signature to look for parameter {param!r} in"
        return None if param in params else f"{path}: no parameter {param!r}"
    if c_name is None:
        return None
    try:
        source = _source_of(obj)
    except (TypeError, OSError):
        return f"{path}: no Python source to look for {c_name} in"
    if c_name not in source:
        return f"{path} does not call {c_name}"
    return None


def check_c_to_python(c: CApi, table: dict, package) -> list:
    problems = []
    lib_module = importlib.import_module(f"{package.__name__}._lib")
    signatures = getattr(lib_module, "_SIGNATURES", {})
    to_py = table.get("c_to_python", {})
    exceptions = table.get("c_exceptions", {})
    struct_map = table.get("c_structs_to_python", {})
    field_map = table.get("c_fields_to_python", {})

    def excepted(key):
        return key in exceptions or key.split(".")[0] in exceptions

    for name, (ret, params) in sorted(c.functions.items()):
        if name not in signatures:
            problems.append(f"C {name} has no ctypes declaration in {lib_module.__name__}."
                            "_SIGNATURES")
        else:
            restype, argtypes = signatures[name]
            want_ret = expected_ctype(ret, c, lib_module)
            if isinstance(want_ret, str) or want_ret is not restype:
                problems.append(f"ctypes {name}: returns {_type_name(restype)}, the C API "
                                f"{ret} ({_wanted(want_ret)})")
            if len(argtypes) != len(params):
                problems.append(f"ctypes {name}: {len(argtypes)} argtypes, the C API "
                                f"{len(params)} parameters")
            for i, ((pname, ptype), have) in enumerate(zip(params, argtypes)):
                want = expected_ctype(ptype, c, lib_module)
                if isinstance(want, str) or want is not have:
                    problems.append(f"ctypes {name}: parameter {i} ({pname}, {ptype}) is "
                                    f"{_type_name(have)}, expected {_wanted(want)}")
        if name in to_py:
            for path in _as_list(to_py[name]):
                reason = _python_counterpart(package, path, name)
                if reason:
                    problems.append(f"mapping [c_to_python] {name}: {reason}")
        elif not excepted(name):
            problems.append(f"C {name} has no Python counterpart: use it in the package and add "
                            "a [c_to_python] entry (or a [c_exceptions] reason)")
    for name in signatures:
        if name not in c.functions:
            problems.append(f"ctypes declares {name}, which weightbus.h does not")

    for struct, fields in sorted(c.structs.items()):
        if not struct.startswith("wb_"):
            continue  # DLPack's: mirrored in _lib, checked by check-layout
        cls = getattr(lib_module, struct, None)
        if cls is None:
            problems.append(f"C struct {struct} has no ctypes Structure in {lib_module.__name__}")
            continue
        names = [f for f, _ in fields]
        declared = [f[0] for f in cls._fields_]
        if declared != names:
            problems.append(f"ctypes {struct} fields {declared} differ from the C fields "
                            f"{names}")
        for (fname, ftype), entry in zip(fields, cls._fields_):
            want = expected_ctype(ftype, c, lib_module)
            if entry[0] == fname and (isinstance(want, str) or want is not entry[1]):
                problems.append(f"ctypes {struct}.{fname} is {_type_name(entry[1])}, expected "
                                f"{_wanted(want)} ({ftype})")
        for i, (fname, _) in enumerate(fields):
            key = f"{struct}.{fname}"
            if fname == "struct_size" or excepted(key):
                continue
            if fname.startswith("num_") and i > 0 and fields[i - 1][0] == fname[4:]:
                continue  # the count of the array before it
            if key in field_map:
                for path in _as_list(field_map[key]):
                    reason = _python_counterpart(package, path, None)
                    if reason:
                        problems.append(f"mapping [c_fields_to_python] {key}: {reason}")
                continue
            owner = struct_map.get(struct)
            if owner is not None:
                names = {fname, fname[:-3] if fname.endswith("_ns") else fname}
                if any(_python_counterpart(package, p, None) is None
                       for n in names for p in (f"{owner}.{n}", f"{owner}({n})")):
                    continue
            problems.append(f"C field {key} has no Python counterpart"
                            f"{' in ' + owner if owner else ''}: add it, or a "
                            "[c_fields_to_python] entry (or a [c_exceptions] reason)")
    for key, paths in list(field_map.items()):
        if not _c_name_exists(c, key):
            problems.append(f"mapping [c_fields_to_python] names {key}, which the C API does "
                            "not declare (stale?)")
    for key in list(to_py) + list(exceptions):
        if not _c_name_exists(c, key.split(".")[0]) and not _c_name_exists(c, key) \
                and key not in c.constants:
            problems.append(f"mapping entry {key} names nothing in weightbus.h (stale?)")

    enum_map = table.get("c_enums_to_python", {})
    for enum, values in sorted(c.enums.items()):
        if enum.startswith("DL"):
            continue  # DLPack's own; _lib's kDL* constants are checked with the constants
        spec = enum_map.get(enum)
        if spec is None:
            if not excepted(enum):
                problems.append(f"C enum {enum} has no [c_enums_to_python] entry")
            continue
        try:
            obj, _, _ = _resolve(package, spec["python"])
        except LookupError as e:
            problems.append(f"[c_enums_to_python] {enum}: {e}")
            continue
        prefix = spec.get("prefix", "")
        for e, value in values.items():
            if e in spec.get("extra", {}):
                try:
                    have, _, _ = _resolve(package, spec["extra"][e])
                except LookupError as err:
                    problems.append(f"[c_enums_to_python] {enum}: {err}")
                    continue
                if have != value:
                    problems.append(f"Python {spec['extra'][e]} is {have}, C {e} is {value}")
            elif spec.get("kind") == "errors":  # {status value: exception class}
                cls = obj.get(value)
                if value != 0 and (cls is None or cls.status_name != e):
                    problems.append(f"C {e} = {value} has no exception class in "
                                    f"{spec['python']}")
            else:  # {name without prefix: value}
                key = e[len(prefix):] if e.startswith(prefix) else e
                if obj.get(key) != value:
                    problems.append(f"C {e} = {value}: {spec['python']}[{key!r}] is "
                                    f"{obj.get(key)!r}")
        if spec.get("kind") != "errors":
            extra = set(obj) - {e[len(prefix):] for e in values}
            if extra:
                problems.append(f"{spec['python']} has {sorted(extra)}, which {enum} lacks")

    for name, value in sorted(c.constants.items()):
        if name in exceptions:
            continue
        have = getattr(lib_module, name, None)
        if have != value:
            problems.append(f"C constant {name} = {value}: {lib_module.__name__}.{name} is "
                            f"{have!r}")
    for name in dir(lib_module):
        if name.startswith("kDL"):
            values = {k: v for e in c.enums.values() for k, v in e.items()}
            if values.get(name) != getattr(lib_module, name):
                problems.append(f"{lib_module.__name__}.{name} is {getattr(lib_module, name)}, "
                                f"DLPack says {values.get(name)}")
    return problems


# ---------------------------------------------------------------------------------------------
# Struct layouts: a generated C program against the ctypes structs
# ---------------------------------------------------------------------------------------------


def emit_layout(c: CApi, includes) -> str:
    lines = ["/* Generated by tests/api_parity/api_parity.py emit-layout: do not edit. */",
             "#include <stddef.h>", "#include <stdio.h>"]
    lines += [f"#include <{i}>" for i in includes]
    lines += ["", "#define FIELD(s, f) \\",
              '  printf("field %s %s %zu %zu\\n", #s, #f, offsetof(s, f), sizeof(((s*)0)->f))',
              "", "int main(void) {"]
    for struct, fields in sorted(c.structs.items()):
        lines.append(f'  printf("struct {struct} %zu %zu\\n", sizeof({struct}), '
                     f"_Alignof({struct}));")
        lines += [f"  FIELD({struct}, {f});" for f, _ in fields]
    lines += ["  return 0;", "}", ""]
    return "\n".join(lines)


def check_layout(output: str, c: CApi, package) -> list:
    problems = []
    lib_module = importlib.import_module(f"{package.__name__}._lib")
    sizes, offsets = {}, {}
    for line in output.splitlines():
        parts = line.split()
        if parts and parts[0] == "struct":
            sizes[parts[1]] = (int(parts[2]), int(parts[3]))
        elif parts and parts[0] == "field":
            offsets[(parts[1], parts[2])] = (int(parts[3]), int(parts[4]))
    for struct in sorted(c.structs):
        cls = getattr(lib_module, struct, None)
        if cls is None:
            if struct.startswith("wb_"):
                problems.append(f"C struct {struct} has no ctypes Structure")
            continue
        if struct not in sizes:
            problems.append(f"the layout program printed nothing for {struct}")
            continue
        size, align = sizes[struct]
        if ctypes.sizeof(cls) != size or ctypes.alignment(cls) != align:
            problems.append(f"{struct}: C sizeof {size} (alignment {align}), ctypes "
                            f"{ctypes.sizeof(cls)} ({ctypes.alignment(cls)})")
        declared = {f[0] for f in cls._fields_}
        for fname, _ in c.structs[struct]:
            if fname not in declared:
                problems.append(f"{struct}.{fname}: no ctypes field")
                continue
            want = offsets.get((struct, fname))
            have = getattr(cls, fname)
            if want is None:
                problems.append(f"the layout program printed nothing for {struct}.{fname}")
            elif (have.offset, have.size) != want:
                problems.append(f"{struct}.{fname}: C offset {want[0]} size {want[1]}, ctypes "
                                f"offset {have.offset} size {have.size}")
        for extra in declared - {f for f, _ in c.structs[struct]}:
            problems.append(f"ctypes {struct}.{extra}: no such C field")
    return problems


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _import_package(python_path):
    sys.path.insert(0, str(python_path))
    return importlib.import_module("weightbus")


def main(argv=None) -> int:
    here = Path(__file__).resolve().parent
    root = here.parents[1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "emit-layout", "check-layout"])
    parser.add_argument("--mapping", type=Path, default=here / "mapping.toml")
    parser.add_argument("--cpp-header", type=Path, action="append",
                        help="C++ header to check (default: [headers] cpp of the mapping)")
    parser.add_argument("--c-header", type=Path, help="default: [headers] c of the mapping")
    parser.add_argument("--dlpack-header", type=Path,
                        default=Path(os.environ.get("WB_DLPACK_HEADER",
                                                    "/usr/include/dlpack/dlpack.h")),
                        help="default: $WB_DLPACK_HEADER or /usr/include/dlpack/dlpack.h")
    parser.add_argument("--python-path", type=Path, default=root / "bindings" / "python")
    parser.add_argument("--layout-binary", type=Path, help="check-layout: the api_layout program")
    parser.add_argument("--layout-output", type=Path, help="check-layout: its saved output")
    parser.add_argument("-o", "--output", type=Path, help="emit-layout: the C file to write")
    args = parser.parse_args(argv)

    table = tomllib.loads(args.mapping.read_text())
    headers = table.get("headers", {})
    c_header = args.c_header or root / headers["c"]
    c = parse_c([args.dlpack_header, c_header])
    if args.command == "emit-layout":
        text = emit_layout(c, ["weightbus/weightbus.h"])
        if args.output:
            args.output.write_text(text)
        else:
            sys.stdout.write(text)
        return 0 if not c.problems else 1
    package = _import_package(args.python_path)
    if args.command == "check":
        cpp = parse_cpp(args.cpp_header or [root / h for h in headers["cpp"]])
        problems = check_cpp_to_c(cpp, c, table) + check_c_to_python(c, table, package)
        summary = (f"{len(cpp.functions)} C++ functions, {len(cpp.fields)} C++ fields, "
                   f"{len(c.functions)} C functions, {len(c.structs)} C structs")
    else:
        if args.layout_output:
            output = args.layout_output.read_text()
        elif args.layout_binary:
            output = subprocess.run([str(args.layout_binary)], check=True, capture_output=True,
                                    text=True).stdout
        else:
            parser.error("check-layout needs --layout-binary or --layout-output")
        problems = c.problems + check_layout(output, c, package)
        summary = f"{len(c.structs)} C structs against {package.__name__}._lib"
    for p in problems:
        print(f"api_parity: {p}")
    if problems:
        print(f"api_parity {args.command}: {len(problems)} problem(s) ({summary})")
        return 1
    print(f"api_parity {args.command}: OK ({summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
