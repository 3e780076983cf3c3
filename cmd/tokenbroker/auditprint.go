package main

import (
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/tokenbroker/tokenbroker/broker/auditjoin"
)

// printable is how every field of the audit table and summary is printed.
// Names, namespaces, resources and paths come from request URLs (percent-
// decoded: any byte), from lease Secrets and from RBAC objects, so a field
// with a control byte (tab and newline included), DEL, a C1 control or
// invalid UTF-8 is printed quoted, Go-escaped ("\x1b", "\n"): it can
// neither end a row, nor move the cursor, nor shift the columns. A field
// with a space is quoted too, its spaces as "\x20", so that every row has
// the same number of whitespace-separated columns; strconv.Unquote (or any
// Go-syntax unquoting) gives the field back. JSON output escapes on its own.
func printable(s string) string { return escapeField(s, false) }

// printableText is printable for a field inside a sentence (a revocation
// reason), where a space shifts no column.
func printableText(s string) string { return escapeField(s, true) }

func escapeField(s string, spaces bool) string {
	if s == "" {
		return s
	}
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size <= 1 || r < 0x20 || (r == ' ' && !spaces) || (r >= 0x7f && r <= 0x9f) ||
			(r == '"' && !spaces) || !strconv.IsGraphic(r) {
			q := strconv.QuoteToASCII(s)
			if !spaces {
				q = strings.ReplaceAll(q, " ", `\x20`)
			}
			return q
		}
		i += size
	}
	return s
}

// printableNone is printable(orNone(s)).
func printableNone(s string) string { return printable(orNone(s)) }

// printablePermission is a permission's "verb resource" with both parts
// printable.
func printablePermission(p auditjoin.Permission) string {
	p.Verb, p.Group, p.Resource, p.Path = printableNone(p.Verb), printable(p.Group), printable(p.Resource), printable(p.Path)
	return p.String()
}
