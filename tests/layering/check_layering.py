#!/usr/bin/env python3
"""Checks that each folder of plugin/ includes only what its CMake target declares.

The dependency table is the one CMake builds from: each `shadowsync_add_component(NAME ...
HEADERS ... DEPENDS ... PRIVATE_DEPENDS ...)` in plugin/**/CMakeLists.txt. A source or private
header of component C may include
  * its own folder's private headers and those of components C depends on ("core/...", ...),
  * public headers (include/shadowsync/X.h) owned by C or by a component C depends on,
and a public header owned by C may include only public headers of C or its dependencies.
Third-party headers that only some components may use (CUDA, NCCL, OpenSSL) are checked too.

Usage: check_layering.py [REPO_ROOT]. Prints every violation; exits 1 if there is one.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[2])
PLUGIN = ROOT / "plugin"

# Third-party headers a component may include only when it links the package.
GUARDED = {
    "CUDA::cudart": re.compile(r"^(cuda|cuda_runtime|cuda_runtime_api|driver_types|cudaTypedefs)\.h$"),
    "CUDA::cuda_driver": re.compile(r"^cuda\.h$"),
    "NCCL::headers": re.compile(r"^nccl\.h$"),
    "OpenSSL::Crypto": re.compile(r"^openssl/"),
}
# The umbrella target of plugin/CMakeLists.txt.
UMBRELLA = "shadowsync"


def parse_components():
    components = {}  # name -> {folder, headers, depends}
    call = re.compile(r"shadowsync_add_component\((.*?)\)", re.S)
    for cmake in sorted(PLUGIN.rglob("CMakeLists.txt")):
        text = re.sub(r"#[^\n]*", "", cmake.read_text())
        for match in call.finditer(text):
            words = match.group(1).split()
            section, fields = None, {"NAME": [], "HEADERS": [], "DEPENDS": [], "PRIVATE_DEPENDS": [],
                                     "EXCLUDE": []}
            for word in words:
                if word in fields:
                    section = word
                else:
                    # $<BUILD_INTERFACE:X> (a dependency kept out of the installed package) is X.
                    fields[section].append(re.sub(r"^\$<BUILD_INTERFACE:(.*)>$", r"\1", word))
            name = "shadowsync_" + fields["NAME"][0]
            # A component declared once per build flavour (with and without CUDA): the union.
            component = components.setdefault(name, {
                "folder": cmake.parent.relative_to(PLUGIN).as_posix(),
                "headers": set(),
                "depends": [],
            })
            component["headers"] |= set(fields["HEADERS"])
            component["depends"] += fields["DEPENDS"] + fields["PRIVATE_DEPENDS"]
    umbrella = re.findall(r"target_link_libraries\(shadowsync INTERFACE([^)]*)\)",
                          (PLUGIN / "CMakeLists.txt").read_text())
    return components, [w for part in umbrella for w in part.split()]


def closure(name, components, umbrella):
    """Every component `name` may use: itself and what it depends on, transitively."""
    seen, todo, packages = set(), [name], set()
    while todo:
        current = todo.pop()
        if current == UMBRELLA:
            todo.extend(umbrella)
            continue
        if current in seen:
            continue
        if current not in components:
            packages.add(current)
            continue
        seen.add(current)
        todo.extend(components[current]["depends"])
    return seen, packages


def main():
    components, umbrella = parse_components()
    if "shadowsync_core" not in components:
        print(f"check_layering: no shadowsync_add_component(NAME core ...) under {PLUGIN}")
        return 1
    owner = {h: n for n, c in components.items() for h in c["headers"]}
    folder_owner = {c["folder"]: n for n, c in components.items()}
    include = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
    problems, checked = [], 0

    def check(path, name):
        nonlocal checked
        allowed, packages = closure(name, components, umbrella)
        allowed_folders = {components[n]["folder"] for n in allowed}
        for bracket, target in include.findall(path.read_text()):
            where = f"{path.relative_to(ROOT)}: #include {target} ({name})"
            if target.startswith("shadowsync/"):
                header = target[len("shadowsync/"):]
                if header not in owner:
                    problems.append(f"{where}: no component owns include/shadowsync/{header}")
                elif owner[header] not in allowed:
                    problems.append(f"{where}: owned by {owner[header]}, not a dependency")
            elif bracket == '"':
                folder = next((f for f in sorted(folder_owner, key=len, reverse=True)
                               if target.startswith(f + "/")), None)
                if target.startswith(".."):
                    problems.append(f"{where}: relative include reaches out of the folder")
                elif folder is not None and folder not in allowed_folders:
                    problems.append(f"{where}: private header of {folder_owner[folder]}, "
                                    "not a dependency")
            else:
                for package, pattern in GUARDED.items():
                    if pattern.search(target) and package not in packages:
                        problems.append(f"{where}: needs {package}, which it does not link")
        checked += 1

    for name, component in components.items():
        folder = PLUGIN / component["folder"]
        for path in sorted(folder.iterdir()):
            if path.suffix in (".cpp", ".cu", ".h", ".cuh"):
                check(path, name)
        for header in component["headers"]:
            path = ROOT / "include" / "shadowsync" / header
            if not path.exists():
                problems.append(f"{component['folder']}/CMakeLists.txt: {name} lists {header}, "
                                "which is not in include/shadowsync/")
            else:
                check(path, name)
    for header in sorted((ROOT / "include" / "shadowsync").glob("*.h")):
        if header.name not in owner:
            problems.append(f"include/shadowsync/{header.name}: no component lists it in HEADERS")

    for problem in problems:
        print(problem)
    print(f"check_layering: {checked} files of {len(components)} components, "
          f"{len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
