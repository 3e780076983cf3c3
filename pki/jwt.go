package pki

import (
	"github.com/golang-jwt/jwt/v5"
)

// UnverifiedClaims reads the registered claims of a JWT without verifying
// its signature, with golang-jwt's parser: for a holder that needs to know
// what a token says (its subject, jti, issue time) while someone else
// verifies it. Never base a decision on what it returns.
func UnverifiedClaims(token string) (jwt.RegisteredClaims, error) {
	var claims jwt.RegisteredClaims
	_, _, err := jwt.NewParser().ParseUnverified(token, &claims)
	return claims, err
}
