"""The recipe's one route."""

from django.urls import path

from . import views

urlpatterns = [path("invoices/<int:pk>/pay", views.pay)]
