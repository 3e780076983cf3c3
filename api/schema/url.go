package schema

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// URLProblem says why s is not a URL the broker may write into the
// kubeconfigs it hands out, or returns "" when it is one. Such a URL is
// printable ASCII (bytes 0x21..0x7e): a space or a control character
// would be read differently, or refused, by the many clients that parse a
// kubeconfig (YAML reads U+0085 as a line break), and a non-ASCII host can
// pass for another (ex\u0430mple.com, with a Cyrillic a). It
// has one of schemes (badScheme is the detail otherwise), a host that is a
// DNS name or an IP address, no user info, no query and no fragment. A
// path is allowed. The detail never repeats the URL, which could hold a
// password.
func URLProblem(s, badScheme string, schemes ...string) string {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x21 || c > 0x7e {
			return fmt.Sprintf("must be printable ASCII without spaces: byte 0x%02x at offset %d is not", c, i)
		}
	}
	u, err := url.Parse(s)
	if err != nil {
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			err = ue.Err // without the URL
		}
		return fmt.Sprintf("is not a URL: %v", err)
	}
	switch {
	case !slices.Contains(schemes, u.Scheme):
		return badScheme
	case u.Host == "":
		return "must have a host"
	case u.User != nil:
		return "must not have user info: every peer's kubeconfig would carry it"
	case strings.Contains(s, "?"):
		return "must not have a query"
	case strings.Contains(s, "#"):
		return "must not have a fragment"
	}
	if detail := HostProblem(u.Hostname()); detail != "" {
		return "host must be a DNS name or an IP address: " + detail
	}
	if port := u.Port(); strings.HasSuffix(u.Host, ":") || port != "" && !ValidPort(port) {
		return "port must be a number from 1 to 65535"
	}
	return ""
}

// HostProblem says why h is neither an IP address nor a DNS name
// (compared without regard to case), or returns "" when it is one.
func HostProblem(h string) string {
	if net.ParseIP(h) != nil { // no IPv6 zone: it means nothing to a peer
		return ""
	}
	if errs := validation.IsDNS1123Subdomain(strings.ToLower(h)); len(errs) > 0 {
		return fmt.Sprintf("%q: %s", h, strings.Join(errs, "; "))
	}
	return ""
}

// ValidPort reports whether s is a port number from 1 to 65535.
func ValidPort(s string) bool {
	n, err := strconv.Atoi(s)
	return err == nil && len(validation.IsValidPortNum(n)) == 0
}
