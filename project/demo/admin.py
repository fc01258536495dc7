from django.contrib import admin

from coordination.admin import FencedModelAdmin

from .models import Account


@admin.register(Account)
class AccountAdmin(FencedModelAdmin):
    list_display = ["id", "owner", "balance", "fence", "fence_step"]
    readonly_fields = ["fence", "fence_step"]
