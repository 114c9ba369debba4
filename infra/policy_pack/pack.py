"""The CrossGuard policies: one mandatory stack policy per infrastructure rule.

``__main__.py`` serves them to the Pulumi engine (``pulumi preview/up --policy-pack
infra/policy_pack``); the kit's tests call :func:`evaluate`, which runs the very same policy
objects over the graph the program asks for under Pulumi's mocks. Each policy is named after
its rule (``rayfleet-rule-11``) and describes it with the registry's title and the place in
docs/security.md that explains it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence

from pulumi_policy.proxy import UnknownValueError
from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ReportViolation,
    StackValidationArgs,
    StackValidationPolicy,
)

from rayfleet.rules import RULES

from .checks import CHECKS, Resource

PACK_NAME = "rayfleet-security"


def policy_name(rule: int) -> str:
    return f"rayfleet-rule-{rule}"


def _stack_list(key: str) -> list:
    """A list setting of the stack, as the engine hands the stack's config to the pack."""
    import pulumi

    raw = pulumi.Config("rayfleet").get(key)
    try:
        value = json.loads(raw) if raw else []
    except json.JSONDecodeError:
        return []  # rayfleet/config.py refuses such a stack before any resource exists
    return value if isinstance(value, list) else []


def _operator_cidrs_from_stack() -> list[str]:
    """The stack's rayfleet:operatorCidrs: rule 4 lets exactly these reach SSH and the
    dashboard."""
    return [str(c) for c in _stack_list("operatorCidrs")]


def _reservations_from_stack() -> list[dict]:
    """The stack's rayfleet:capacityReservations: rule 31 holds each template to one."""
    return [c for c in _stack_list("capacityReservations") if isinstance(c, dict)]


def to_resource(r: PolicyResource) -> Resource:
    """A CrossGuard resource as the checks read it. ``props`` stays CrossGuard's own mapping,
    which raises UnknownValueError on a value a preview cannot know yet."""
    deps = {k: tuple(d.urn for d in v) for k, v in (r.property_dependencies or {}).items()}
    return Resource(type=r.resource_type, name=r.name, inputs=r.props, outputs=r.props,
                    urn=r.urn, parent=r.parent.urn if r.parent else "", deps=deps)


def _validator(rule: int, operator_cidrs: Callable[[], Sequence[str]],
               reservations: Callable[[], Sequence[dict]]):
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        resources = [to_resource(r) for r in args.resources]
        for v in CHECKS[rule](resources, operator_cidrs=operator_cidrs(),
                              capacity_reservations=reservations()):
            report_violation(f"{v} (see {RULES[rule].anchor})", v.urn or None)
    return validate


def policies(operator_cidrs: Sequence[str] | None = None,
             capacity_reservations: Sequence[dict] | None = None
             ) -> list[StackValidationPolicy]:
    """One stack policy per rule the resource graph shows. ``operator_cidrs`` or
    ``capacity_reservations`` None: read the stack's own config when the engine runs the
    pack."""
    cidrs = (lambda: list(operator_cidrs)) if operator_cidrs is not None \
        else _operator_cidrs_from_stack
    reserved = (lambda: list(capacity_reservations)) if capacity_reservations is not None \
        else _reservations_from_stack
    return [StackValidationPolicy(
        name=policy_name(n),
        description=f"Rule {n}: {RULES[n].title} ({RULES[n].anchor})",
        validate=_validator(n, cidrs, reserved),
        enforcement_level=EnforcementLevel.MANDATORY,
        url=RULES[n].anchor,
    ) for n in sorted(CHECKS)]


def evaluate(resources: Sequence[PolicyResource], rules: Iterable[int] | None = None, *,
             operator_cidrs: Sequence[str] = (),
             capacity_reservations: Sequence[dict] = (),
             not_runnable: list[str] | None = None) -> list[tuple[str, str | None]]:
    """(message, urn) of every violation the pack's policies report over ``resources``, as
    the engine would collect them; ``rules`` limits it to those rules' policies. A policy
    that needs a value the preview cannot know yet is, as the engine does, not failed but
    noted in ``not_runnable``."""
    wanted = {policy_name(n) for n in (CHECKS if rules is None else rules)}
    reported: list[tuple[str, str | None]] = []
    for policy in policies(operator_cidrs, capacity_reservations):
        if policy.name not in wanted:
            continue
        found: list[tuple[str, str | None]] = []

        def report(message: str, urn: str | None = None,
                   found: list[tuple[str, str | None]] = found) -> None:
            found.append((message, urn))

        try:
            policy.validate(StackValidationArgs(list(resources)), report)
        except UnknownValueError:
            if not_runnable is not None:
                not_runnable.append(policy.name)
            continue
        reported += found
    return reported

