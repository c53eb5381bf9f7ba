// The console's only script: refresh the overview's live part, and ask before an action.
"use strict";

function refreshLive(box) {
  const every = Number(box.dataset.everyMs) || 3000;
  async function tick() {
    try {
      const answer = await fetch(box.dataset.refresh, {credentials: "same-origin",
                                                       headers: {"Accept": "text/html"}});
      if (answer.redirected) {
        window.location.reload();  // logged out: the gate sent the fetch to the login form
      } else if (answer.ok) {
        box.innerHTML = await answer.text();  // rendered and escaped by the server
        box.dataset.refreshedAt = String(Date.now());
      }
    } catch (err) {
      // the server is restarting: try again next tick
    }
    window.setTimeout(tick, every);
  }
  window.setTimeout(tick, every);
}

function confirmActions() {
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) {
        event.preventDefault();
      }
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const live = document.getElementById("live");
  if (live) {
    refreshLive(live);
  }
  confirmActions();
});
