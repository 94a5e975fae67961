// Arrow keys step the slides by clicking the ◀ / ▶ buttons (ignored while typing in a field). A focused
// radio or checkbox (the centering toggle after a click) would otherwise take the arrows for itself.
document.addEventListener("keydown", function (event) {
  var target = event.target;
  var tag = target && target.tagName ? target.tagName.toLowerCase() : "";
  var type = tag === "input" ? (target.type || "").toLowerCase() : "";
  var choice = type === "radio" || type === "checkbox";
  if ((tag === "input" && !choice) || tag === "textarea" || tag === "select" || (target && target.isContentEditable)) {
    return;
  }
  var id = event.key === "ArrowRight" ? "next-slide" : event.key === "ArrowLeft" ? "prev-slide" : null;
  if (!id) { return; }
  var button = document.getElementById(id);
  if (button) { event.preventDefault(); button.click(); }
});
