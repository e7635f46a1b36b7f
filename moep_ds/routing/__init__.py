"""Routers: token -> expert assignment as a RoutingPlan (expert choice, top-k token choice)."""
from moep_ds.routing.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter
from moep_ds.routing.plan import RoutingPlan
from moep_ds.routing.router import Router
from moep_ds.routing.topk import TopKConfig, TopKRouter

__all__ = ["ExpertChoiceConfig", "ExpertChoiceRouter", "Router", "RoutingPlan", "TopKConfig", "TopKRouter"]
