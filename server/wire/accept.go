package wire

import (
	"strconv"
	"strings"
)

// maxAcceptRanges bounds the work spent on one Accept header.
const maxAcceptRanges = 32

// mediaRange is one element of an Accept header.
type mediaRange struct {
	typ, sub string
	q        float64
}

// Negotiate picks the offer the Accept header prefers (RFC 9110 §12.5.1):
// the most specific range matching an offer gives it its q-value, and the
// highest q wins. Among equal q-values an offer named explicitly beats one
// matched by a wildcard (so "application/yaml, */*" means YAML), and then
// the earlier offer wins. An absent, empty or wholly unparsable header
// accepts the first offer. It reports false when no offer is acceptable,
// which the caller answers with 406.
func Negotiate(accept string, offers ...string) (string, bool) {
	ranges := parseAccept(accept)
	if len(ranges) == 0 {
		return offers[0], true
	}
	best, bestQ, bestSpec := "", 0.0, -1
	for _, offer := range offers {
		typ, sub, _ := strings.Cut(offer, "/")
		q, spec := offerQ(ranges, typ, sub)
		if q > bestQ || (q == bestQ && q > 0 && spec > bestSpec) {
			best, bestQ, bestSpec = offer, q, spec
		}
	}
	return best, bestQ > 0
}

// offerQ returns the q-value and the specificity (2 exact, 1 type/*, 0 */*)
// of the most specific range matching typ/sub; q is 0 if none matches.
func offerQ(ranges []mediaRange, typ, sub string) (q float64, specificity int) {
	specificity = -1
	for _, r := range ranges {
		s := -1
		switch {
		case r.typ == typ && r.sub == sub:
			s = 2
		case r.typ == typ && r.sub == "*":
			s = 1
		case r.typ == "*" && r.sub == "*":
			s = 0
		}
		if s > specificity {
			q, specificity = r.q, s
		}
	}
	return q, specificity
}

// parseAccept parses the media ranges of an Accept header, dropping those
// it cannot parse. Parameters other than q are ignored.
func parseAccept(h string) []mediaRange {
	var out []mediaRange
	for part := range strings.SplitSeq(h, ",") {
		if len(out) == maxAcceptRanges {
			break
		}
		fields := strings.Split(part, ";")
		typ, sub, ok := strings.Cut(strings.ToLower(strings.TrimSpace(fields[0])), "/")
		if !ok || typ == "" || sub == "" || (typ == "*" && sub != "*") {
			continue
		}
		r := mediaRange{typ: typ, sub: sub, q: 1}
		valid := true
		for _, p := range fields[1:] {
			k, v, _ := strings.Cut(strings.TrimSpace(p), "=")
			if !strings.EqualFold(strings.TrimSpace(k), "q") {
				continue
			}
			q, ok := parseQ(strings.TrimSpace(v))
			if !ok {
				valid = false
				break
			}
			r.q = q
			break // parameters after q are accept-extensions
		}
		if valid {
			out = append(out, r)
		}
	}
	return out
}

// parseQ parses an RFC 9110 qvalue: "0" or "1", optionally followed by a
// dot and up to three digits, and at most 1.
func parseQ(v string) (float64, bool) {
	if v == "" || len(v) > 5 || (v[0] != '0' && v[0] != '1') {
		return 0, false
	}
	if len(v) > 1 {
		if v[1] != '.' {
			return 0, false
		}
		for i := 2; i < len(v); i++ {
			if v[i] < '0' || v[i] > '9' {
				return 0, false
			}
		}
	}
	q, err := strconv.ParseFloat(v, 64)
	if err != nil || q > 1 {
		return 0, false
	}
	return q, true
}
