// Package problem classifies the broker's failures by what the caller can do
// about them: a Kind (invalid, forbidden, not found, unavailable, over a
// limit…) on an *Error whose Detail is safe to show and whose Err is for the
// log only. Classify turns an error of the Kubernetes API into one. The
// server maps a Kind to an HTTP status and a problem+json body in exactly one
// place; nothing here knows HTTP.
package problem
